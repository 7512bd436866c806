"""A seeded fault injector for a supervised single-node run.

Fault kinds: ``rank_kill`` (SIGKILL one rank), ``rank_stop`` (SIGSTOP one rank: must be caught as a hang),
``supervisor_kill`` (SIGKILL rlsup alone: its job must die with it, a new rlsup resumes from the state dir),
``node_kill`` (SIGKILL rlsup and every rank at once), ``supervisor_stop`` (SIGSTOP rlsup for a while, then
SIGCONT: must cost nothing). Moments: ``random`` (a random instant of training), ``mid_save`` (the victim's
``.staging-rank_*`` dir exists), ``mid_manifest`` (the victim's files are in place but its manifest is not:
temp manifest or no manifest yet), ``mid_load`` (the victim is inside ``restore``). A moment that is not
reached within its deadline falls back to ``random`` and is recorded as missed (``hit=False``).

Every random choice comes from ``random.Random(seed)`` so a failing soak iteration is replayed with its seed
(timing still varies: which instant a poll catches is up to the scheduler).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from rlsup_format.heartbeat_record import rank_file_name
from trainer_hooks.heartbeat import read_record
from rlsup_format.manifest import list_step_dirs, manifest_name
from rlsup_format.names import Kind, parse_reserved

from support.procs import pid_alive, promptly, rlsup_cmd
from support.waits import Deadline, wait_for

from .common import sandbox_env
from .invariants import ProcessTracker, valid_steps

# The last rlsup generation of a plan, after its last fault: no restart follows, so a warm launcher armed beside its
# attempt (torchrun and a warm rank per local rank, the CPU of a cold start) would never be used.
NO_WARM_LAUNCHER = ("--warm-launcher", "false")

KINDS = ("rank_kill", "rank_stop", "supervisor_kill", "node_kill", "supervisor_stop")
MOMENTS = ("random", "mid_save", "mid_manifest", "mid_load")


def written_by(name: str, kind: Kind, pid: int, label: str = "") -> bool:
    """Whether ``name`` is a reserved entry (rlsup_format.names) of ``kind`` written by ``pid``
    whose label starts with ``label`` (a staging dir ``rank_...``, a temp manifest ``manifest.rank_...``)."""
    res = parse_reserved(name)
    return res is not None and res.kind is kind and res.pid == pid and res.label.startswith(label)


@dataclass
class Fault:
    kind: str
    moment: str
    injected: bool = False
    hit: bool = False  # the requested moment was caught (else it fell back to a random instant)
    attempt: int | None = None
    step: int | None = None  # the victim's last heartbeat step when the fault hit
    victim: int | None = None
    valid_before: set[int] = field(default_factory=set)
    note: str = ""

    @property
    def steps_lost(self) -> int:
        if self.step is None or not self.injected or self.kind == "supervisor_stop":
            return 0
        return max(0, self.step - max(self.valid_before, default=0))


class SupervisedRun:
    """`rlsup run` of the example trainer in a sandbox; restartable after its supervisor was killed."""

    def __init__(self, sandbox, job: list[str], rlsup_args: list[str], env: dict[str, str] | None = None) -> None:
        self.sandbox = sandbox
        self.job = job
        self.rlsup_args = rlsup_args
        self.env = sandbox_env(sandbox, **(env or {}))
        self.tracker = ProcessTracker(sandbox.state).start()
        self.proc: subprocess.Popen | None = None
        self.generation = 0
        self.survivor_problems: list[str] = []

    def start(self, extra: Sequence[str] = ()) -> subprocess.Popen:
        """A new rlsup generation; ``extra``: flags of this start only, after the run's."""
        log = open(self.sandbox.run / f"rlsup.{self.generation}.log", "ab")
        self.proc = subprocess.Popen(rlsup_cmd("run", *self.rlsup_args, *extra, "--", *self.job), cwd=self.sandbox.run,
                                     env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.generation += 1
        self.tracker.add_root(self.proc.pid)
        return self.proc

    def state(self) -> dict:
        try:
            return json.loads((self.sandbox.state / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    def heartbeats(self, attempt: int) -> Path:
        return self.sandbox.state / "attempts" / f"attempt_{attempt:04d}" / "heartbeats"

    def ranks(self, attempt: int) -> dict[int, "object"]:
        out = {}
        for path in self.heartbeats(attempt).glob("rank_*.hb"):
            rec = read_record(path)
            if rec is not None and rec.pid:
                out[rec.rank] = rec
        return out

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise Deadline(f"rlsup did not finish within {timeout}s:\n{self.log_tail()}") from None

    def kill_all(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for pid in self.tracker.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def log_tail(self, n: int = 6000) -> str:
        text = ""
        for i in range(self.generation):
            p = self.sandbox.run / f"rlsup.{i}.log"
            if p.exists():
                text += f"--- rlsup generation {i} ---\n" + p.read_text(errors="replace")[-n:]
        return text


class FaultInjector:
    def __init__(self, run: SupervisedRun, world: int, steps: int, seed: int, moment_timeout: float = 30.0,
                 stop_hold: float = 2.0, every: int = 3) -> None:
        self.run = run
        self.world = world
        self.steps = steps
        self.every = every  # the trainer's --checkpoint-every: how far the next save is from a heartbeat's step
        self.rng = random.Random(seed)
        self.moment_timeout = moment_timeout
        self.stop_hold = stop_hold
        self.faults: list[Fault] = []
        self._faulted_attempts: set[int] = set()

    # ------------------------------------------------------------ waiting for an attempt and a moment

    def _fresh_attempt(self) -> int | None:
        """The attempt this rlsup generation runs now, unless a fault already hit it."""
        st = self.run.state()
        if st.get("state") != "running" or st.get("pid") != self.run.proc.pid:
            return None
        attempt = int(st.get("attempt", -1))
        return None if attempt in self._faulted_attempts else attempt

    def _registered(self, attempt: int) -> dict | None:
        """Every rank of ``attempt`` by its heartbeat record, once each has one naming a live pid."""
        hb = self.run.heartbeats(attempt)
        ranks = {}
        for rank in range(self.world):
            rec = read_record(hb / rank_file_name(rank))
            if rec is None or not rec.pid or not pid_alive(rec.pid):
                return None
            ranks[rank] = rec
        return ranks

    def _live_attempt(self, what: str, fine: bool) -> tuple[int, dict] | None:
        """A fresh attempt with every rank registered; None once rlsup ended. One poll at two rates: the ranks,
        which register after their imports, every 0.5 ms when ``fine`` (mid_load: the restore that follows lasts a
        few ms) by their heartbeat files alone; rlsup's state.json (which attempt runs) at most every 20 ms. An
        attempt that ended before all its ranks registered gives way to the next."""
        run, seen = self.run, {"attempt": None, "read_at": float("-inf")}

        def live() -> tuple[int | None, dict | None] | None:
            if run.proc.poll() is not None:
                return None, None
            now = time.monotonic()
            if now - seen["read_at"] >= 0.02:
                seen["attempt"], seen["read_at"] = self._fresh_attempt(), now
            attempt = seen["attempt"]
            ranks = self._registered(attempt) if attempt is not None else None
            return (attempt, ranks) if ranks else None

        attempt, ranks = wait_for(live, 180, what, interval=0.0005 if fine else 0.02)
        return None if attempt is None else (attempt, ranks)

    def _staging_of(self, pid: int) -> bool:
        for _, d in list_step_dirs(self.run.sandbox.ckpt):
            try:
                for e in os.scandir(d):
                    if written_by(e.name, Kind.STAGING, pid, "rank_"):
                        return True
            except OSError:
                continue
        return False

    def _mid_manifest(self, rank: int, pid: int) -> bool:
        """Temp manifest of this pid, or this rank's data file in place but no manifest yet."""
        mname = manifest_name(rank)
        for _step, d in list_step_dirs(self.run.sandbox.ckpt)[-2:]:
            try:
                names = os.listdir(d)
            except OSError:
                continue
            if any(written_by(n, Kind.TMP, pid, mname) for n in names):
                return True
            data = f"rank_{rank:05d}.pt"
            if data in names and mname not in names and not any(written_by(n, Kind.STAGING, pid) for n in names):
                return True
        return False

    def _strobe_manifest(self, rank: int, pid: int, slice_s: float = 0.0003) -> bool:
        """The manifest window (data in place, manifest not yet) lasts a few ms: too short to catch by
        polling on a loaded machine. So, once the victim is inside a save, let it run in short slices
        (SIGCONT, sleep, SIGSTOP) and look while it is frozen, at real-time priority (:func:`promptly`) so that
        a slice lasts what it says under load. True: caught, the victim is left STOPPED (the caller injects,
        then continues it); False: the save ended without being caught."""
        deadline = time.monotonic() + 20
        with promptly():
            caught = self._strobe(rank, pid, slice_s, deadline)
        if not caught:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        return caught

    def _strobe(self, rank: int, pid: int, slice_s: float, deadline: float) -> bool:
        try:
            while time.monotonic() < deadline and pid_alive(pid):
                os.kill(pid, signal.SIGSTOP)
                wait_for(lambda: _proc_state(pid) in ("T", "t", "Z", "X", None), 5, "the victim to stop",
                         interval=0.0002)
                if self._mid_manifest(rank, pid):
                    return True
                if not self._staging_of(pid):
                    # Staging gone and no manifest window seen: the save is over, not caught.
                    break
                os.kill(pid, signal.SIGCONT)
                time.sleep(slice_s)
        except (ProcessLookupError, Deadline):
            pass
        return False

    def _wait_moment(self, fault: Fault, attempt: int, rank: int, pid: int) -> bool:
        """Until the victim is at the fault's moment. Save moments look at its checkpoint dir only while its
        heartbeat says it is inside a save, and every 10 ms instead of 0.5 ms while its next save is a whole
        step or more away (the step's sleep comes first): not a core spun polling a directory between saves."""
        hb = self.run.heartbeats(attempt) / rank_file_name(rank)
        deadline = time.monotonic() + self.moment_timeout
        if fault.moment == "random":
            time.sleep(self.rng.uniform(0.05, 0.8))
            return True
        while time.monotonic() < deadline and pid_alive(pid):
            rec = read_record(hb)
            if fault.moment == "mid_load":
                if rec is not None and rec.section == "load":
                    return True
                if rec is not None and rec.beat_ns > 0:
                    return False  # the load is over for this attempt
            elif rec is not None and rec.step >= self.steps - 4:
                return False  # training nearly over: fall back to a random instant while there is one
            elif rec is not None and rec.section == "save":
                if fault.moment == "mid_save" and self._staging_of(pid):
                    return True
                if fault.moment == "mid_manifest" and self._staging_of(pid) and self._strobe_manifest(rank, pid):
                    return True
            elif rec is not None and (-rec.step) % self.every >= 2:
                time.sleep(0.01)  # the next save comes after at least one more step
                continue
            time.sleep(0.0005)
        return False

    # ------------------------------------------------------------ injecting

    def inject(self, kind: str, moment: str, last: bool = False) -> Fault:
        """Inject one fault of the plan; ``last``: no fault follows, so an rlsup started after this one (a supervisor
        or node kill) arms no warm launcher: its attempt runs to the end and nothing would ever use one."""
        fault = Fault(kind, moment)
        self.faults.append(fault)
        run = self.run
        found = self._live_attempt(f"a fresh live attempt for fault {kind}@{moment}", fine=moment == "mid_load")
        if found is None:
            fault.note = "rlsup already finished"
            return fault
        attempt, ranks = found
        fault.attempt = attempt
        rank = self.rng.randrange(self.world)
        pid = ranks[rank].pid
        fault.victim = pid
        fault.valid_before = valid_steps(run.sandbox.ckpt) if moment != "mid_load" else set()
        fault.hit = self._wait_moment(fault, attempt, rank, pid)
        if moment == "mid_load":
            fault.valid_before = valid_steps(run.sandbox.ckpt)
        rec = run.ranks(attempt).get(rank)
        fault.step = rec.step if rec is not None else None
        if not pid_alive(pid) or run.proc.poll() is not None or (fault.step or 0) >= self.steps - 1:
            fault.note = "job already past the fault window"
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            return fault
        if kind == "rank_kill":
            os.kill(pid, signal.SIGKILL)
        elif kind == "rank_stop":
            os.kill(pid, signal.SIGSTOP)
        elif kind == "supervisor_kill":
            run.proc.send_signal(signal.SIGKILL)
        elif kind == "node_kill":
            run.proc.send_signal(signal.SIGKILL)
            for r in ranks.values():
                try:
                    os.kill(r.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        elif kind == "supervisor_stop":
            run.proc.send_signal(signal.SIGSTOP)
            time.sleep(self.stop_hold)
            run.proc.send_signal(signal.SIGCONT)
        else:
            raise ValueError(kind)
        fault.injected = True
        if kind != "rank_stop":
            try:
                os.kill(pid, signal.SIGCONT)  # the strobe may have left it frozen; a SIGKILL wins anyway
            except ProcessLookupError:
                pass
        if kind != "supervisor_stop":
            self._faulted_attempts.add(attempt)  # the next fault waits for the next attempt
        if kind in ("supervisor_kill", "node_kill"):
            run.proc.wait(timeout=30)
            # The job must die with its supervisor (PR_SET_PDEATHSIG) before anything else happens.
            from .invariants import check_no_survivors

            run.tracker.sample()
            run.survivor_problems += check_no_survivors(run.tracker, timeout=20)
            run.start(NO_WARM_LAUNCHER if last else ())
        return fault

    def random_plan(self, n: int, kinds=KINDS, moments=MOMENTS) -> list[tuple[str, str]]:
        return [(self.rng.choice(kinds), self.rng.choice(moments)) for _ in range(n)]


def _proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return None
