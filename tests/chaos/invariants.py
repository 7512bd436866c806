"""Invariants checked after every chaos scenario. Each ``check_*`` returns a list of problems ('' free);
an empty list means the invariant holds. Scenarios collect them and fail with all problems at once.

- :func:`check_weights`: the final weights equal the uninterrupted run's, bit for bit.
- :func:`check_valid_not_lost`: every step that was valid when a fault was injected is still valid, or
  was removed only by ``keep_last`` retention (at least ``keep_last`` newer valid steps exist).
- :func:`check_no_writes_outside`: nothing new or changed in the sentinel parent, and only the
  configured directories at the top of the sandbox.
- :class:`ProcessTracker` / :func:`check_no_survivors`: no process of the job outlived its supervisor.
- :func:`check_incidents`: incidents.jsonl accounts for every injected fault that killed an attempt.
- :func:`check_steps_match_reference`: every step that verifies holds exactly the uninterrupted run's
  state of that step (a torn or mixed snapshot that still verifies would be caught here).
- :func:`check_no_stale_holds` / :func:`check_no_temp_copies`: no retention hold of a dead process and no
  temp copy (persistent tier, peer fetch) is left behind once a run ended.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Iterable

import psutil

from supervisor.processes.children import descendants
from trainer_hooks.heartbeat import read_record
from rlsup_format.names import Kind, parse_reserved
from rlsup_format.manifest import list_step_dirs, verify_step_dir


# ------------------------------------------------------------------ files


def snapshot_tree(root: Path, exclude: Iterable[Path] = ()) -> dict[str, tuple]:
    """relpath -> (kind, size, mtime_ns) of everything under ``root`` except ``exclude`` subtrees."""
    excluded = {os.path.realpath(p) for p in exclude}
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if os.path.realpath(os.path.join(dirpath, d)) not in excluded]
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            kind = "d" if os.path.isdir(p) and not os.path.islink(p) else "f"
            out[os.path.relpath(p, root)] = (kind, st.st_size if kind == "f" else 0,
                                             st.st_mtime_ns if kind == "f" else 0)
    return out


def check_no_writes_outside(sandbox, allowed_top: Iterable[str]) -> list[str]:
    """The sentinel parent is unchanged (except the sandbox's run dir) and run/ holds only ``allowed_top``."""
    problems = []
    now = snapshot_tree(sandbox.parent, exclude=(sandbox.run,))
    for rel in sorted(set(now) | set(sandbox.parent_snapshot)):
        if now.get(rel) != sandbox.parent_snapshot.get(rel):
            problems.append(f"outside the sandbox: {rel} changed ({sandbox.parent_snapshot.get(rel)} -> {now.get(rel)})")
    allowed = set(allowed_top) | {"tmp", "home"}
    for entry in os.listdir(sandbox.run):
        if entry not in allowed:
            problems.append(f"unexpected top-level entry written in the sandbox: {entry}")
    return problems


def valid_steps(ckpt_dir: Path, full: bool = True) -> set[int]:
    return {step for step, path in list_step_dirs(ckpt_dir) if verify_step_dir(path, full=full).valid}


def check_valid_not_lost(snapshots: Iterable[set[int]], ckpt_dir: Path, keep_last: int | None) -> list[str]:
    """Every step valid at some snapshot is still valid, or retention removed it legitimately."""
    problems = []
    present = {step for step, _ in list_step_dirs(ckpt_dir)}
    now_valid = valid_steps(ckpt_dir)
    for step in sorted(set().union(*snapshots) if snapshots else set()):
        if step in present:
            if step not in now_valid:
                r = verify_step_dir(ckpt_dir / f"step_{step:09d}", full=True)
                problems.append(f"step {step} was valid and is now invalid: {r.reason}")
            continue
        newer = sorted(s for s in now_valid if s > step)
        if keep_last is None or len(newer) < keep_last:
            problems.append(f"valid step {step} was deleted but only {len(newer)} newer valid steps exist "
                            f"(keep_last={keep_last})")
    return problems


def check_no_leftovers(ckpt_dir: Path, allow_dead_staging: bool = False) -> list[str]:
    """No half-written temp files or staging dirs of dead processes remain after a run ended cleanly."""
    problems = []
    for root, dirs, files in os.walk(ckpt_dir):
        for name in dirs + files:
            if name.startswith(".staging-") and not allow_dead_staging:
                problems.append(f"leftover staging dir {os.path.join(root, name)}")
            res = parse_reserved(name)
            temp_manifest = res is not None and res.kind is Kind.TMP and res.label.startswith("manifest")
            if temp_manifest or (name.startswith(".manifest.") and ".tmp-" in name):
                problems.append(f"leftover temp manifest {os.path.join(root, name)}")
            if name.startswith(".deleting-"):
                problems.append(f"leftover half-deleted step {os.path.join(root, name)}")
    return problems


# ------------------------------------------------------------------ weights


def check_weights(path: Path, ref: dict) -> list[str]:
    from .common import same_weights

    diff = same_weights(path, ref)
    return [diff] if diff else []


# ------------------------------------------------------------------ processes


class ProcessTracker:
    """Remembers every process seen under the tracked roots (rlsup instances) and in heartbeat files."""

    def __init__(self, state_dir: Path, interval: float = 0.1) -> None:
        self.state_dir = state_dir
        self.interval = interval
        self.roots: list[int] = []
        self.seen: dict[int, float] = {}  # pid -> create_time
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="chaos-proc-tracker")

    def start(self) -> "ProcessTracker":
        self._thread.start()
        return self

    def add_root(self, pid: int) -> None:
        with self._lock:
            self.roots.append(pid)
        self.sample()

    def _remember(self, pid: int) -> None:
        if pid in self.seen:  # the first sighting's start time names the process (a reused pid is another one)
            return
        try:
            self.seen[pid] = psutil.Process(pid).create_time()
        except psutil.Error:
            pass

    def sample(self) -> None:
        """Every process below the roots, and each rank a heartbeat names. The tree walks the kernel's children
        files (as rlsup does), not psutil's scan of every process on the host ten times a second."""
        with self._lock:
            roots = list(self.roots)
        for pid in roots:
            below = descendants(pid)
            if below is None:
                try:
                    below = [c.pid for c in psutil.Process(pid).children(recursive=True)]
                except psutil.Error:
                    continue
            for child in below:
                self._remember(child)
        for hb in self.state_dir.glob("attempts/*/heartbeats/rank_*.hb"):
            rec = read_record(hb)
            if rec is not None and rec.pid:
                self._remember(rec.pid)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def alive(self) -> list[int]:
        out = []
        for pid, ctime in list(self.seen.items()):
            if pid in self.roots:
                continue
            try:
                p = psutil.Process(pid)
                if p.create_time() == ctime and p.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                    out.append(pid)
            except psutil.Error:
                continue
        return out


def check_no_survivors(tracker: ProcessTracker, timeout: float = 20.0) -> list[str]:
    """Every job process seen is gone within ``timeout`` of its supervisor's end (PDEATHSIG is asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = tracker.alive()
        if not alive:
            return []
        if time.monotonic() > deadline:
            desc = []
            for pid in alive:
                try:
                    desc.append(f"{pid} {' '.join(psutil.Process(pid).cmdline())[:120]}")
                except psutil.Error:
                    desc.append(str(pid))
            for pid in alive:  # do not leak them into other tests
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
            return [f"job processes outlived their supervisor: {desc}"]
        time.sleep(0.1)


# ------------------------------------------------------------------ incidents

EXPECTED_REASONS = {
    "rank_kill": {"signal", "exit_code"},
    # Stopped inside a save/load section: save_timeout (the first restore too, since soak seed
    # kill-w1:1665032077 showed it was held to startup_timeout); stopped before registering: startup_timeout.
    "rank_stop": {"hang", "save_timeout", "startup_timeout"},
    # The async writer died: the trainer's next save() or wait() raises AsyncSaveError (exit 1).
    "writer_kill": {"exit_code"},
    "supervisor_kill": {"supervisor_lost"},
    "node_kill": {"supervisor_lost"},
}


def check_incidents(state_dir: Path, faults: list) -> list[str]:
    """One incident per injected fault that killed an attempt, with a matching reason, in order."""
    from support.incidents import incidents

    inc = [i for i in incidents(state_dir) if i.get("reason") not in ("success",)]
    killing = [f for f in faults if f.injected and f.kind in EXPECTED_REASONS]
    problems = []
    if len(inc) != len(killing):
        problems.append(f"{len(killing)} attempt-killing faults injected "
                        f"({[(f.kind, f.moment) for f in killing]}) but {len(inc)} incidents: "
                        f"{[(i['attempt'], i['reason'], i.get('detail', '')[:80]) for i in inc]}")
        return problems
    for f, i in zip(killing, inc):
        if i["reason"] not in EXPECTED_REASONS[f.kind]:
            problems.append(f"fault {f.kind}@{f.moment} (attempt {f.attempt}) recorded as {i['reason']}: {i.get('detail')}")
        if i.get("action") != "restart":
            problems.append(f"fault {f.kind} led to action {i.get('action')}, expected restart")
        newest = max(f.valid_before) if f.valid_before else None
        if i.get("resumed_step") is not None and newest is not None and i["resumed_step"] < newest:
            problems.append(f"after {f.kind} the next attempt resumed from step {i['resumed_step']}, "
                            f"but step {newest} was valid")
    return problems + check_triage(state_dir, incidents(state_dir))


def check_triage(state_dir: Path, recorded: list[dict]) -> list[str]:
    """`rlsup incidents` on the run's state dir (offline, from incidents.jsonl alone) agrees with it."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "supervisor.cli.main", "incidents", "--json", str(state_dir)],
                         capture_output=True, text=True, timeout=60)
    if not recorded:
        return [] if out.returncode in (0, 1) else [f"rlsup incidents failed: {out.stderr[-500:]}"]
    if out.returncode != 0:
        return [f"rlsup incidents exited {out.returncode}: {out.stderr[-500:]}"]
    summary = json.loads(out.stdout)["summary"]
    restarts = sum(i.get("action") == "restart" for i in recorded)
    if (summary["incidents"], summary["restarts"]) != (len(recorded), restarts):
        return [f"rlsup incidents summarized {summary['incidents']} incidents / {summary['restarts']} restarts; "
                f"incidents.jsonl has {len(recorded)} / {restarts}"]
    return []


# ------------------------------------------------------------------ tiers: content, holds, temp copies


def check_steps_match_reference(ckpt_dir: Path, ref_ckpt: Path, world: int) -> list[str]:
    """Every step of ``ckpt_dir`` that verifies holds the same payload (model, optimizer, sampler, RNG, ...)
    as the same step of an uninterrupted run (:func:`tests.chaos.common.reference_checkpoints`)."""
    import torch

    from .common import payload_diff

    problems = []
    for step, path in list_step_dirs(ckpt_dir):
        if not verify_step_dir(path, full=True).valid:
            continue
        ref = ref_ckpt / path.name
        if not ref.is_dir():
            problems.append(f"valid step {step} does not exist in the uninterrupted run")
            continue
        for rank in range(world):
            name = f"rank_{rank:05d}.pt"
            try:
                got = torch.load(path / name, weights_only=True)
            except FileNotFoundError:
                continue
            diff = payload_diff(got, torch.load(ref / name, weights_only=True))
            if diff:
                problems.append(f"valid step {step} rank {rank} differs from the uninterrupted run's: {diff}")
    return problems


def _pid_of_suffix(name: str) -> int | None:
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def check_no_stale_holds(ckpt_dir: Path) -> list[str]:
    """No ``.hold-persistent-<pid>`` marker of a dead process pins a step (retention skips held steps, so a
    stale marker keeps that step forever)."""
    problems = []
    for step, path in list_step_dirs(ckpt_dir):
        try:
            names = os.listdir(path)
        except OSError:
            continue
        for name in names:
            if not name.startswith(".hold-persistent"):
                continue
            res = parse_reserved(name)  # .hold-persistent-<host>-<pid>-<token> (rlsup_format.names)
            pid = res.pid if res is not None else _pid_of_suffix(name)
            if pid is None or not psutil.pid_exists(pid):
                problems.append(f"step {step}: stale retention hold {name} of a dead process (the step can never "
                                f"be deleted by keep_last)")
    return problems


def check_no_temp_copies(*roots: Path) -> list[str]:
    """No temp copy is left: a reserved TMP or INCOMING name (rlsup_format.names: persistent tier,
    peer fetches, copies; also the older ``.incoming-*``, ``.fetch-*`` and ``*.rlsup-*.tmp`` names),
    directly under a root or inside its step directories."""
    problems = []
    for root in roots:
        dirs = [root] + [p for _, p in list_step_dirs(root)]
        for d in dirs:
            try:
                names = os.listdir(d)
            except OSError:
                continue
            for name in names:
                res = parse_reserved(name)
                if ((res is not None and res.kind in (Kind.TMP, Kind.INCOMING))
                        or name.startswith(".incoming-") or name.startswith(".fetch-")
                        or (name.startswith(".") and ".rlsup-" in name and name.endswith(".tmp"))):
                    problems.append(f"leftover temp copy {os.path.join(d, name)}")
    return problems
