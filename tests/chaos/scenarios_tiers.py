"""Chaos scenarios for the checkpoint tiers: asynchronous saves (a writer process) and the persistent tier.

- :func:`async_write_scenario`: the trainer saves with ``CheckpointManager(async_save=True)``
  (``tests/chaos/async_trainer.py``); a rank, the writer process itself, rlsup alone, or rlsup and the
  whole job are SIGKILLed while the background writer is inside a write (its staging dir exists, or its
  data file is in place and its manifest is not). The writer is frozen (SIGSTOP) while the moment is
  confirmed, so the fault lands inside the write, never just after it.
- :func:`persistent_copy_scenario`: rlsup copies valid steps to a persistent tier (``persistent_dir``,
  bandwidth-capped so a copy lasts); rlsup (alone, or with its job) is SIGKILLed while a step is being
  copied (a ``.incoming-`` dir exists there), optionally the local checkpoint directory is then wiped,
  and rlsup is SIGKILLed again while it fetches the step back from the persistent tier.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
from pathlib import Path

import psutil

from rlsup_format.manifest import list_step_dirs, manifest_name, read_manifest, step_dir_name, verify_step_dir
from rlsup_format.names import Kind, parse_manifest_rank, parse_reserved
from supervisor.processes.children import children
from supervisor.tiers.fetch_staging import PREFIX as STAGING_PREFIX

from support.env import PY
from support.incidents import incidents
from support.procs import freeze, pid_alive, promptly, thaw
from support.waits import Deadline, wait_for

from .common import STEPS, Sandbox, launcher, reference_checkpoints, reference_weights, train_args
from .injector import NO_WARM_LAUNCHER, Fault, FaultInjector, SupervisedRun, written_by
from .invariants import (check_incidents, check_no_leftovers, check_no_stale_holds, check_no_survivors,
                         check_no_temp_copies, check_no_writes_outside, check_steps_match_reference,
                         check_valid_not_lost, check_weights, valid_steps)
from .scenarios import ALLOWED_TOP, ScenarioResult

ASYNC_TRAIN = str(Path(__file__).with_name("async_trainer.py"))
ASYNC_KINDS = ("rank_kill", "writer_kill", "supervisor_kill", "node_kill")
ASYNC_MOMENTS = ("mid_write", "mid_manifest")

# Flags shared with kill_scenario: fast restarts; a rank frozen inside a save is held to save_timeout.
RLSUP_FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--max-restarts", "50", "--kill-grace", "2",
              "--startup-timeout", "120", "--save-timeout", "15"]


def async_launcher(world: int) -> list[str]:
    if world == 1:
        return [PY, ASYNC_TRAIN]
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), ASYNC_TRAIN]


def writer_of(pid: int) -> int | None:
    """The live async checkpoint writer process started by the rank ``pid``."""
    try:
        kids = psutil.Process(pid).children()
    except psutil.Error:
        return None
    for k in kids:
        try:
            if "trainer_hooks.async_writer" in " ".join(k.cmdline()) and k.status() != psutil.STATUS_ZOMBIE:
                return k.pid
        except psutil.Error:
            continue
    return None


# ------------------------------------------------------------------ asynchronous saves


class AsyncFaultInjector(FaultInjector):
    """Faults while the background writer of a rank writes a step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.partial_problems: list[str] = []

    def _staging_dir_of(self, wpid: int) -> Path | None:
        """The step dir in which the writer ``wpid`` has its staging dir (it is inside a write)."""
        for _, d in reversed(list_step_dirs(self.run.sandbox.ckpt)):
            try:
                if any(written_by(n, Kind.STAGING, wpid) for n in os.listdir(d)):
                    return d
            except OSError:
                continue
        return None

    def _phase(self, d: Path, rank: int, wpid: int) -> str:
        """Where the writer ``wpid`` is in its write of step dir ``d``: staging (files being written),
        manifest (files in place, manifest not: temp manifest or none yet), done, or gone."""
        mname = manifest_name(rank)
        try:
            names = os.listdir(d)
        except OSError:
            return "gone"
        if any(written_by(n, Kind.STAGING, wpid) for n in names):
            return "staging"
        if any(written_by(n, Kind.TMP, wpid, mname) for n in names):
            return "manifest"
        if f"rank_{rank:05d}.pt" in names and mname not in names:
            return "manifest"
        return "done"

    def _catch(self, moment: str, rank: int, pid: int, wpid: int, hb: Path) -> tuple[Path | None, str]:
        """Wait until the writer is inside a write; freeze it there (``mid_write``: staging dir present;
        ``mid_manifest``: its files in place and its manifest not, found by letting it run in short slices).
        Returns the step dir being written, with the writer left STOPPED, or None and why it was not caught."""
        from trainer_hooks.heartbeat import read_record

        deadline = time.monotonic() + self.moment_timeout
        polls = 0
        # Let a few writes of this attempt go by (seeded), and never catch one before some step is valid:
        # "nothing older is lost" must have something to hold.
        skip = self.rng.randint(0, 2)
        passed: set[Path] = set()
        while time.monotonic() < deadline and pid_alive(wpid) and pid_alive(pid):
            polls += 1
            if polls % 50 == 0:
                rec = read_record(hb)
                if rec is not None and rec.step >= self.steps - 2:
                    return None, f"training nearly over (step {rec.step}); {len(passed)} write(s) let by or missed"
            d = self._staging_dir_of(wpid)
            if d is not None and d not in passed and (len(passed) < skip or not valid_steps(self.run.sandbox.ckpt,
                                                                                             full=False)):
                passed.add(d)
                d = None
            if d is not None and d not in passed and freeze(wpid):
                phase = self._phase(d, rank, wpid)
                if moment == "mid_write" and phase == "staging":
                    return d, ""
                if moment == "mid_manifest" and phase == "staging":
                    with promptly():
                        phase = self._strobe_to_manifest(d, rank, wpid)
                if moment == "mid_manifest" and phase == "manifest":
                    return d, ""
                passed.add(d)  # this write was missed (or its writer would not stop): wait for the next
                thaw(wpid)
            time.sleep(0.002)  # a write (6 MB, fsync, hash) lasts tens of ms: a few looks each, not a spun core
        if time.monotonic() >= deadline:
            return None, f"no write caught in {self.moment_timeout:.0f} s"
        return None, "the writer or its rank ended"

    def _strobe_to_manifest(self, d: Path, rank: int, wpid: int) -> str:
        """Let the frozen writer run in slices of 0.3 ms until it leaves the staging phase of ``d``; its phase
        then, with the writer STOPPED ("manifest": caught), or "lost" when it would not stop again (left
        running: still inside a syscall after 5 s)."""
        phase = "staging"
        strobe_end = time.monotonic() + 20
        while phase == "staging" and time.monotonic() < strobe_end:
            thaw(wpid)
            time.sleep(0.0003)
            if not freeze(wpid):
                return "lost"
            phase = self._phase(d, rank, wpid)
        return phase

    def inject_async(self, kind: str, moment: str, last: bool = False) -> Fault:
        """One fault of the plan (``last``: as :meth:`FaultInjector.inject`)."""
        fault = Fault(kind, moment)
        self.faults.append(fault)
        run = self.run
        found = self._live_attempt(f"a fresh live attempt for fault {kind}@{moment}", fine=False)
        if found is None:
            fault.note = "rlsup already finished"
            return fault
        attempt, ranks = found
        fault.attempt = attempt
        rank = self.rng.randrange(self.world)
        pid = ranks[rank].pid
        wpid = wait_for(lambda: run.proc.poll() is not None or not pid_alive(pid) or writer_of(pid), 60,
                        f"rank {rank}'s async writer process")
        if wpid is True or not pid_alive(pid):
            fault.note = "the attempt ended before its writer started"
            return fault
        run.tracker._remember(wpid)  # it must die with its rank, and its rank with rlsup
        hb = run.sandbox.state / "attempts" / f"attempt_{attempt:04d}" / "heartbeats" / f"rank_{rank:05d}.hb"
        target, why = self._catch(moment, rank, pid, wpid, hb)
        if target is None:
            thaw(wpid)
            fault.note = f"the writer was never caught inside a write: {why}"
            return fault
        fault.hit = True
        # The writer is frozen inside the write of `target`: nothing it writes changes under us now.
        writing = int(target.name.split("_")[1])
        fault.valid_before = valid_steps(run.sandbox.ckpt)
        rec = run.ranks(attempt).get(rank)
        fault.step = rec.step if rec is not None else None
        fault.victim = wpid if kind == "writer_kill" else pid
        fault.note = f"writer {wpid} frozen writing step {writing}"
        if kind == "rank_kill":
            os.kill(pid, signal.SIGKILL)
        elif kind == "writer_kill":
            os.kill(wpid, signal.SIGKILL)
        elif kind == "supervisor_kill":
            run.proc.send_signal(signal.SIGKILL)
        elif kind == "node_kill":
            run.proc.send_signal(signal.SIGKILL)
            for r in ranks.values():
                for victim in (writer_of(r.pid), r.pid):
                    if victim:
                        try:
                            os.kill(victim, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
        else:
            raise ValueError(kind)
        fault.injected = True
        self._faulted_attempts.add(attempt)
        # The writer stays frozen until it is dead: a stopped process still dies of SIGKILL (its rank's
        # PR_SET_PDEATHSIG included), and thawing it earlier would let it finish the write in the few ms
        # the kernel takes to tear its rank down - a complete, legitimate checkpoint, but not a killed write.
        self.partial_problems += self._check_killed_write(rank, wpid, writing, kind)
        if kind in ("supervisor_kill", "node_kill"):
            run.proc.wait(timeout=30)
            run.tracker.sample()
            run.survivor_problems += check_no_survivors(run.tracker, timeout=20)
            run.start(NO_WARM_LAUNCHER if last else ())
        return fault

    def _check_killed_write(self, rank: int, wpid: int, step: int, kind: str) -> list[str]:
        """The writer must be gone within 20 s (it dies with its rank), and the step it was writing must not
        verify with this writer's manifest: a killed write never looks like a checkpoint."""
        problems = []
        try:
            wait_for(lambda: not pid_alive(wpid), 20, f"the writer {wpid} to die after {kind}")
        except Deadline:
            try:
                cmd = " ".join(psutil.Process(wpid).cmdline())[:120]
            except psutil.Error:
                cmd = "?"
            problems.append(f"{kind}: the async writer {wpid} ({cmd}) outlived its rank/supervisor by 20 s")
            try:
                os.kill(wpid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            thaw(wpid)
        d = self.run.sandbox.ckpt / step_dir_name(step)
        if verify_step_dir(d, full=True).valid:
            try:
                writer = read_manifest(d / manifest_name(rank)).extra.get("writer_pid")
            except Exception:  # a manifest that vanished is not ours to judge here
                writer = None
            if writer == wpid:
                problems.append(f"{kind}: step {step} verifies although its writer {wpid} was killed mid-write")
        return problems


def _final_weights(path: Path) -> dict:
    import torch

    return torch.load(path, weights_only=True)


def async_write_scenario(parent: Path, ref_cache: Path, seed: int, world: int = 1,
                         plan: list[tuple[str, str]] | None = None, n_faults: int = 4, steps: int = STEPS,
                         keep_last: int = 2, require_injected: bool = True) -> ScenarioResult:
    """SIGKILL of a rank, of the async writer, of rlsup, or of rlsup and the job, mid-async-write. Then:
    the killed write never verifies, every valid step holds the uninterrupted run's state of that step,
    nothing older is lost, no writer outlives its rank or supervisor, every fault has its incident, and
    the final weights equal a synchronous uninterrupted run's."""
    started = time.monotonic()
    res = ScenarioResult(f"async-w{world}", seed)
    sb = Sandbox(parent)
    args = train_args(steps=steps, keep_last=keep_last)
    ref_ckpt = reference_checkpoints(ref_cache, world, args)
    ref = _final_weights(ref_ckpt.parent / "final.pt")  # that same uninterrupted run's: no second reference run
    # No fault here stops a rank, so nothing is meant to be caught by save_timeout; 15 s (RLSUP_FAST) was tripped
    # once in CI by a rank waiting on its writer's write behind the other workers' I/O (a fourth incident, a
    # save_timeout, beside three faults). Given more, a writer the harness failed to thaw is still caught.
    run = SupervisedRun(sb, [*async_launcher(world), *args, "--out", str(sb.run / "final.pt")],
                        [*RLSUP_FAST, "--heartbeat-timeout", "6", "--save-timeout", "60"])
    inj = AsyncFaultInjector(run, world, steps, seed)
    if plan is None:
        plan = [(inj.rng.choice(ASYNC_KINDS), inj.rng.choice(ASYNC_MOMENTS)) for _ in range(n_faults)]
    try:
        run.start()
        for i, (kind, moment) in enumerate(plan):
            inj.inject_async(kind, moment, last=i == len(plan) - 1)
        code = run.wait_exit(timeout=600)
        run.tracker.sample()
        res.faults = inj.faults
        if code != 0:
            res.problems.append(f"rlsup exited {code}")
        res.check(inj.partial_problems)
        res.check(run.survivor_problems)
        res.check(check_no_survivors(run.tracker))
        res.check(check_weights(sb.run / "final.pt", ref))
        res.check(check_steps_match_reference(sb.ckpt, ref_ckpt, world))
        res.check(check_valid_not_lost([f.valid_before for f in inj.faults], sb.ckpt, keep_last))
        res.check(check_no_writes_outside(sb, ALLOWED_TOP))
        res.check(check_incidents(sb.state, inj.faults))
        res.check(check_no_leftovers(sb.ckpt))
        res.check([f"fault {f.kind}@{f.moment} not injected: {f.note}" for f in inj.faults
                   if not f.injected and require_injected])
        res.check([] if any(f.injected for f in inj.faults) else ["no fault of the plan was injected"])
        res.restarts = len([i for i in incidents(sb.state) if i.get("action") == "restart"])
    except Exception as e:
        res.problems.append(f"{type(e).__name__}: {e}")
        res.faults = inj.faults
    finally:
        run.kill_all()
        run.tracker.stop()
        res.log = run.log_tail()
        res.seconds = time.monotonic() - started
    return res


# ------------------------------------------------------------------ persistent tier

def _incoming(root: Path, pid: int | None = None) -> list[tuple[int, Path]]:
    """(step, path) of the temp files of part copies in ``root``'s step directories and in the fetch staging
    directories beside them (of process ``pid`` or a child of its when given: rlsup copies on a mount from a child
    forked per pass): reserved TMP names (rlsup_format.names) beside the files they become."""
    found = []
    roots = [root, *sorted(root.glob(STAGING_PREFIX + "*"))]  # a whole-step fetch lands in staging first
    for step, step_dir in (entry for r in roots for entry in list_step_dirs(r)):
        for dirpath, _dirs, files in os.walk(step_dir):
            for n in files:
                res = parse_reserved(n)
                if res is not None and res.kind is Kind.TMP:
                    found.append((step, Path(dirpath) / n, res.pid))
    if pid is None or not found:
        return [(step, path) for step, path, _ in found]
    writers = {pid, *_children_of(pid)}  # only when there is a temp file to attribute
    return [(step, path) for step, path, writer in found if writer in writers]


def _children_of(pid: int) -> set[int]:
    """``pid``'s children, from the kernel's children files (psutil's walk reads every process on the host)."""
    kids = children(pid)
    if kids is not None:
        return set(kids)
    try:
        return {c.pid for c in psutil.Process(pid).children()}
    except psutil.Error:
        return set()


def _lacks_a_manifest(step_dir: Path) -> bool:
    """Whether some rank's manifest is missing in ``step_dir`` (a part cut off before its commit)."""
    ranks = {r for n in os.listdir(step_dir) if (r := parse_manifest_rank(n)) is not None}
    try:
        return not ranks or ranks != set(range(read_manifest(step_dir / manifest_name(min(ranks))).world_size))
    except (OSError, ValueError):
        return False


def persistent_copy_scenario(parent: Path, ref_cache: Path, seed: int,
                             plan: list[tuple[str, str, bool]] | None = None, n_faults: int = 2, steps: int = STEPS,
                             keep_last: int = 2, persistent_keep_last: int = 2,
                             bandwidth: float = 25e6, require_injected: bool = True) -> ScenarioResult:
    """rlsup (alone: ``supervisor_kill``, or with its job: ``node_kill``) SIGKILLed while it copies a step to
    the persistent tier (``mid_copy``), or while the next rlsup fetches the step back after the local
    directory was wiped (``mid_fetch``). A plan entry is (kind, moment, wipe the local dir afterwards).
    Invariants: the partial copy never has a step's name and is never offered; nothing older is lost in
    either tier; after a wipe the run resumes from the persistent tier's newest valid step; the final
    weights equal the uninterrupted run's; no temp copy or stale retention hold of a dead rlsup remains."""
    from supervisor.tiers.persistent import PersistentTier

    started = time.monotonic()
    rng = random.Random(seed)
    res = ScenarioResult("persistent", seed)
    sb = Sandbox(parent)
    dest = sb.run / "persistent" / "chaos"  # rlsup keeps the job's copies under <persistent_dir>/<job_name>/
    args = train_args(steps=steps, keep_last=keep_last)
    ref = reference_weights(ref_cache, 1, args)
    rlsup_args = [*RLSUP_FAST, "--heartbeat-timeout", "6", "--persistent-dir", str(dest.parent), "--job-name", "chaos",
                  "--persistent-bandwidth", str(bandwidth), "--persistent-keep-last", str(persistent_keep_last),
                  "--replication-scan-interval", "0.1"]
    run = SupervisedRun(sb, [*launcher(1), *args, "--out", str(sb.run / "final.pt")], rlsup_args)
    if plan is None:
        plan = []
        for _ in range(n_faults):
            wipe = rng.random() < 0.5
            plan.append((rng.choice(["supervisor_kill", "node_kill"]), "mid_copy", wipe))
            if wipe and rng.random() < 0.5:
                plan.append(("supervisor_kill", "mid_fetch", False))
    faults: list[Fault] = []
    local_snaps: list[set[int]] = []
    tier_snaps: list[set[int]] = []
    problems: list[str] = []
    pending: list[tuple[str, int, str | None, bool]] = []  # the resume the current rlsup must make

    def wait_moment(moment: str) -> tuple[int, Path] | None:
        """Freeze rlsup with a copy in flight (mid_copy: into the tier, which already holds a valid step;
        mid_fetch: from the tier into the local dir) and return (step, temp dir); None if never seen."""
        pid = run.proc.pid
        root = dest if moment == "mid_copy" else sb.ckpt
        deadline = time.monotonic() + 60
        polls = 0
        while time.monotonic() < deadline and run.proc.poll() is None:
            polls += 1
            if moment == "mid_copy" and polls % 20 == 0:
                st = run.state()
                recs = run.ranks(int(st.get("attempt", 0))) if st.get("pid") == pid else {}
                if any(r.step >= steps - 2 for r in recs.values()):
                    return None  # training nearly over
            if _incoming(root, pid) and (moment == "mid_fetch" or valid_steps(dest, full=False)):
                # the pass's child writing the temp files (forked per pass on a mount), frozen with rlsup so the
                # copy stays in flight; never rlsup's other children (the guardian must see rlsup die)
                copiers = {w for _, t in _incoming(root, pid) if (w := parse_reserved(t.name).pid) != pid}
                if freeze(pid) and all(freeze(c) for c in copiers):
                    inc = _incoming(root, pid)
                    if inc and (moment == "mid_fetch" or valid_steps(dest)):
                        return inc[0]
                for p in (pid, *copiers):
                    thaw(p)
            time.sleep(0.005)  # a bandwidth-capped copy of a step lasts about 0.25 s
        return None

    def check_resume() -> None:
        """The rlsup started after the last fault launched its job from the expected step and tier."""
        if not pending:
            return
        what, expect_step, expect_tier, exact = pending.pop()
        new = run.proc.pid
        st = wait_for(lambda: run.proc.poll() is not None or
                      (run.state().get("pid") == new and run.state().get("state") == "running" and run.state()),
                      120, f"the new rlsup to launch after {what}")
        if st is True:
            problems.append(f"after {what} the new rlsup ended ({run.proc.returncode}) before launching")
            return
        got_step, got_tier = st.get("resume_step"), st.get("resume_tier")
        if got_step is None or got_step < expect_step or (exact and got_step != expect_step):
            problems.append(f"after {what} the run resumed from step {got_step} ({got_tier}), expected "
                            f"{'' if exact else 'at least '}step {expect_step}")
        if expect_tier is not None and got_tier != expect_tier:
            problems.append(f"after {what} the run resumed from the {got_tier} tier (step {got_step}), expected "
                            f"the {expect_tier} tier")

    try:
        run.start()
        for kind, moment, wipe in plan:
            fault = Fault(kind, moment)
            faults.append(fault)
            if moment == "mid_copy":
                check_resume()
            caught = wait_moment(moment)
            if caught is None:
                fault.note = "no copy in flight was caught"
                check_resume()
                continue
            step_copied, tmp = caught
            local_before = valid_steps(sb.ckpt)
            tier_before = valid_steps(dest)
            st = run.state()
            job = run.ranks(int(st.get("attempt", 0))) if st.get("state") == "running" else {}
            fault.hit, fault.valid_before = True, local_before
            fault.step = max((r.step for r in job.values()), default=None)
            fault.note = f"{kind}@{moment} of step {step_copied} ({tmp.name})"
            job_pids = [r.pid for r in job.values()] if kind == "node_kill" else []
            run.proc.send_signal(signal.SIGKILL)
            for p in job_pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            fault.injected = True
            run.proc.wait(timeout=30)
            run.tracker.sample()
            problems.extend(check_no_survivors(run.tracker, timeout=20))
            # The partial copy stays behind (its owner is dead) but never has a step's name, never verifies,
            # and a tier opened now (as a new rlsup opens it) offers only what was valid before.
            if moment == "mid_copy":
                now_valid = valid_steps(dest)
                # Copies are per part, manifest last: a killed one leaves a part without its manifest.
                problems.extend([f"{fault.note}: persistent step {s} has every manifest but does not verify"
                                 for s, p in list_step_dirs(dest) if s not in now_valid and not _lacks_a_manifest(p)])
                if step_copied in now_valid - tier_before:
                    problems.append(f"{fault.note}: step {step_copied} became valid in the tier from a killed copy")
                newest = PersistentTier(dest).latest_valid()
                if newest is None or newest.step != max(tier_before, default=None):
                    problems.append(f"{fault.note}: the tier offers {newest} instead of step "
                                    f"{max(tier_before, default=None)}")
            elif step_copied in valid_steps(sb.ckpt) - local_before:
                problems.append(f"{fault.note}: step {step_copied} became valid locally from a killed fetch")
            problems.extend(check_valid_not_lost([tier_before], dest, persistent_keep_last))
            tier_snaps.append(tier_before)
            if wipe:
                shutil.rmtree(sb.ckpt)  # the node's local disk is gone
                fault.note += ", local dir wiped"
            else:
                problems.extend(check_valid_not_lost([local_before], sb.ckpt, keep_last))
                local_snaps.append(local_before)
            pending.clear()  # a killed fetch never launched: the next rlsup owes the same resume
            if wipe or moment == "mid_fetch":
                pending.append((fault.note, max(tier_before, default=0), "persistent", True))
            else:
                pending.append((fault.note, max(local_before | tier_before, default=0), None, False))
            run.start()
        check_resume()
        code = run.wait_exit(timeout=600)
        run.tracker.sample()
        res.faults = faults
        res.check([] if code == 0 else [f"rlsup exited {code}"])
        res.check(problems)
        res.check(run.survivor_problems)
        res.check(check_no_survivors(run.tracker))
        res.check(check_weights(sb.run / "final.pt", ref))
        res.check(check_valid_not_lost(local_snaps, sb.ckpt, keep_last))
        res.check(check_valid_not_lost(tier_snaps, dest, persistent_keep_last))
        res.check(check_incidents(sb.state, faults))
        res.check(check_no_leftovers(sb.ckpt))
        res.check(check_no_temp_copies(sb.ckpt, dest))
        res.check(check_no_stale_holds(sb.ckpt))
        final_valid = valid_steps(dest)
        res.check([f"persistent step {s} does not verify" for s, _ in list_step_dirs(dest) if s not in final_valid])
        res.check(check_no_writes_outside(sb, ALLOWED_TOP | {"persistent"}))
        res.check([f"fault {f.kind}@{f.moment} not injected: {f.note}" for f in faults
                   if not f.injected and require_injected])
        res.check([] if any(f.injected for f in faults) else ["no fault of the plan was injected"])
        res.restarts = len([i for i in incidents(sb.state) if i.get("action") == "restart"])
    except Exception as e:
        res.problems.append(f"{type(e).__name__}: {e}")
        res.faults = faults
    finally:
        run.kill_all()
        run.tracker.stop()
        res.log = run.log_tail()
        res.seconds = time.monotonic() - started
    return res
