"""A checkpoint directory that stops answering mid-save (issue 32): real rlsup, torchrun (gloo, CPU) and
examples/train_tiny.py over a FUSE mount (tests/support/sick_fs.py) told to hang.

A rank whose write the mount never answers sleeps in the kernel; SIGKILL turns that into state D, and the
attempt cannot be torn down. The contract: the hang is reported with the rank, the state D, the file and the
mount; the node is excluded (exit 77, ``unhealthy_nodes``); nothing is launched beside the stuck rank; and
rlsup's own process exits 77 within 30 s of that verdict with the mount still hung (issue 41): nothing of its own
is held by the mount (its passes over the job's directories run in forked children, left behind and named with
the ranks in ``unkillable.json``'s ``exit``), so the code reaches the batch script. Once the mount heals the
stuck processes end (the test's mounts are always healed and unmounted).
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rlsup_format.digest import copy_hashing
from rlsup_format.manifest import SCHEMA_VERSION, RankManifest, latest_valid
from rlsup_format.names import manifest_name, step_dir_name
from supervisor.membership import node_name
from supervisor.run.node_health import read_unhealthy
from trainer_hooks.heartbeat import rank_file_name, read_record
from support.env import PY, TRAIN, clean_env
from support.incidents import incidents
from support.metrics import parse, try_scrape, value
from support.ports import free_ports
from support.procs import pid_alive, proc_state
from support.sick_fs import ALL_BUT_FLUSH, SickFs, unavailable
from support.trainers import Supervised
from support.waits import wait_for

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--max-restarts", "5", "--poll-interval", "0.1"]
# Where neither the rank count nor the warm launcher is the subject (a hung mount is met by one rank as by two;
# CONTRIBUTING.md "Suite time"): one rank, no warm launcher (torchrun's agent and one rank a launch, where rlsup's
# defaults start six processes by attempt 1). rlsup's defaults (2 ranks, a warm launcher armed beside a hung
# mount) stay test_checkpoint_dir_hung_mid_save_excludes_the_node's, the chaos subset's scenario.
LEAN = ("--warm-launcher", "false")


def torchrun(*train: str, ranks: int = 2) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), TRAIN, *train]


@pytest.fixture
def sick(tmp_path: Path):
    with SickFs(tmp_path / "backing", tmp_path / "mnt", tmp_path / "sick") as fs:
        yield fs


def gave_up(state_dir: Path) -> dict | None:
    """state.json once rlsup has given up (written before rlsup's process ends)."""
    try:
        state = json.loads((state_dir / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if state.get("state") == "gave_up" else None


@pytest.fixture
def sick_tier(tmp_path: Path):
    """A second sick mount (the persistent tier's)."""
    with SickFs(tmp_path / "tier_backing", tmp_path / "tier_mnt", tmp_path / "tier_sick") as fs:
        yield fs


def hung_save_run(workdir: Path, sick: SickFs, hang: dict, extra: tuple[str, ...] = (),
                  before_hang=None, ranks: int = 2) -> tuple[Supervised, dict, dict]:
    """Train (``ranks`` ranks) into the sick mount until a step is valid (then ``before_hang()``), hang it as
    ``hang`` says, and wait until rlsup gave up: (the run, state.json, unkillable.json), the mount still hung
    (the caller heals it)."""
    run = Supervised.start(workdir, [*FAST, "--checkpoint-dir", str(sick.mountpoint), "--save-timeout", "2",
                                     "--heartbeat-timeout", "30", "--kill-grace", "2", *extra],
                           torchrun("--steps", "2000", "--checkpoint-every", "2", "--step-time", "0.02", ranks=ranks),
                           clean_env(OMP_NUM_THREADS="1", TORCH_FR_BUFFER_SIZE="0"))
    try:
        wait_for(lambda: latest_valid(sick.root, full=False), 90, "a first valid step through the mount")
        if before_hang is not None:
            before_hang(run)
        sick.hang(**hang)
        wait_for(lambda: sick.status()["held"], 30, "a rank's call held by the hung mount")
        state = wait_for(lambda: gave_up(run.state_dir), 120, "rlsup to give up on the unkillable attempt")
    except BaseException:
        sick.heal()
        run.proc.kill()
        run.proc.wait(30)
        raise
    record = run.state_dir / "unkillable.json"
    return run, state, json.loads(record.read_text()) if record.exists() else {}


def check_unkillable(workdir: Path, sick: SickFs, run: Supervised, state: dict, record: dict) -> list[dict]:
    """The invariants of an attempt stuck in the mount, checked while it is still hung; its processes."""
    stuck = record.get("processes", [])
    mount = str(sick.mountpoint)
    assert state["exit_code"] == 77, run.output()[-3000:]
    assert stuck and all(p["state"] == "D" and p["wchan"] for p in stuck), record
    assert all(p["mounts"] == [mount] and (str(p["waiting_on"]) + "/").startswith(mount + "/") for p in stuck), \
        json.dumps(record)
    assert None not in {p["rank"] for p in stuck} and {p["rank"] for p in stuck} <= {0, 1}, record
    assert all(proc_state(p["pid"]) == "D" for p in stuck), "the stuck ranks are still held by the mount"
    assert read_unhealthy(run.state_dir) == [node_name()]
    last = incidents(run.state_dir)[-1]
    assert (last["reason"], last["action"]) == ("unkillable", "exclude_node"), last
    assert "state D" in last["detail"] and f"mount {mount} not answering" in last["detail"], last["detail"]
    assert f"rank {stuck[0]['rank']}" in last["detail"] and "save_timeout" in last["detail"], last["detail"]
    attempts = sorted(d.name for d in (run.state_dir / "attempts").iterdir())
    assert attempts == ["attempt_0000"], f"an attempt launched beside the unkillable one: {attempts}"
    return stuck


#: How soon after the verdict rlsup's process must be gone, whatever the mount holds (issue 41).
EXIT_AFTER_VERDICT_S = 30.0


def exits_while_hung(run: Supervised, mounts: list[str], stuck: list[dict]) -> dict:
    """With the mount(s) still hung: rlsup's process exits 77 within EXIT_AFTER_VERDICT_S of the verdict (the
    last incident's time), waited on, and its ``exit`` record names the mounts and what it left (the stuck
    ranks, by pid); the record."""
    verdict = incidents(run.state_dir)[-1]["time"]
    try:
        code = run.proc.wait(max(0.1, verdict + EXIT_AFTER_VERDICT_S - time.time()))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"rlsup still running {time.time() - verdict:.0f}s after the verdict, the mount hung "
                             f"(threads: {sorted(os.listdir(f'/proc/{run.proc.pid}/task'))})\n"
                             + run.output()[-3000:]) from None
    assert code == 77, run.output()[-3000:]
    assert not pid_alive(run.proc.pid)
    left = json.loads((run.state_dir / "unkillable.json").read_text()).get("exit")
    assert left is not None and left["code"] == 77, run.output()[-3000:]
    assert set(mounts) <= set(left["mounts"]), left
    assert set(left["ranks"]) == {p["pid"] for p in stuck if pid_alive(p["pid"])}, left
    assert left["threads"] == [], f"a thread of rlsup's own held by a mount: {left['threads']}"
    return left


def healed_end(sick: SickFs, stuck: list[dict]) -> None:
    """Heal and unmount: the stuck ranks get their answer and die."""
    sick.close()
    for p in stuck:
        wait_for(lambda p=p: not pid_alive(p["pid"]), 30, f"stuck pid {p['pid']} to end once the mount healed")


def hung_save_ends_unkillable(tmp_path: Path, sick: SickFs, hang: dict, extra: tuple[str, ...] = (),
                              ranks: int = 2) -> dict:
    """A save hung as ``hang`` says: the invariants while it is held, rlsup's exit while it is held, then the
    healed end (healed, and rlsup killed, whatever fails); what rlsup's exit record says it left."""
    run, state, record = hung_save_run(tmp_path, sick, hang, extra, ranks=ranks)
    try:
        stuck = check_unkillable(tmp_path, sick, run, state, record)
        left = exits_while_hung(run, [str(sick.mountpoint)], stuck)
    except BaseException:
        sick.heal()
        if run.proc.poll() is None:
            run.proc.kill()
        raise
    healed_end(sick, stuck)
    return left


@pytest.mark.chaos  # the chaos CI subset's hung-filesystem scenario (issue 32)
def test_checkpoint_dir_hung_mid_save_excludes_the_node(tmp_path: Path, sick: SickFs) -> None:
    """Writes hang mid-save: the save outlives save_timeout, the ranks are SIGKILLed, the ones in the mount's
    write stay in state D; rlsup names them (rank, state, wchan, file, mount), gives up with 77 and this node
    in unhealthy_nodes, never launches attempt 1 beside them, and its process is gone within 30 s of the
    verdict with the mount still hung."""
    hung_save_ends_unkillable(tmp_path, sick, {"ops": ("write",)})


def test_checkpoint_dir_hung_rlsup_exits_leaving_its_own_pass(tmp_path: Path, sick: SickFs) -> None:
    """Every call but flush hangs mid-save (a server gone), rlsup's own reads of the directory included: its
    single-file pass is held in the mount too. rlsup exits 77 within 30 s of the verdict all the same, the mount
    still hung, naming the mount, the stuck ranks and its own pass it left behind (a forked child, in the
    mount); none of its own threads is held there."""
    # LEAN: the run never restarts (one attempt, asserted)
    left = hung_save_ends_unkillable(tmp_path, sick, {"ops": ALL_BUT_FLUSH}, LEAN, ranks=1)
    passes = [h for h in left["helpers"] if h["label"] == "rlsup-file-versions"]
    assert passes and all(h["mounts"] == [str(sick.mountpoint)] for h in passes), left


def test_persistent_tier_hung_too_rlsup_exits_leaving_its_copy(tmp_path: Path, sick: SickFs,
                                                              sick_tier: SickFs) -> None:
    """The persistent tier's mount hangs with a copy held in it, then the checkpoint mount mid-save: rlsup
    gives up (77) on the unkillable ranks and exits within 30 s, both mounts still hung, its final copy skipped;
    its exit record names both mounts and the tier's copy it left behind (a forked child)."""
    def hang_the_tier(run: Supervised) -> None:
        wait_for(lambda: "copied to the persistent tier" in run.output(), 90, "a first persistent copy")
        sick_tier.hang(ops=ALL_BUT_FLUSH)
        wait_for(lambda: sick_tier.status()["held"], 30, "the tier's next pass held by its hung mount")

    run, state, record = hung_save_run(tmp_path, sick, {"ops": ("write",)},  # LEAN: one attempt, asserted
                                       ("--persistent-dir", str(sick_tier.mountpoint), *LEAN), hang_the_tier, ranks=1)
    try:
        stuck = check_unkillable(tmp_path, sick, run, state, record)
        left = exits_while_hung(run, [str(sick.mountpoint), str(sick_tier.mountpoint)], stuck)
        copies = [h for h in left["helpers"] if h["label"] == "rlsup-persistent-tier"]
        assert copies and str(sick_tier.mountpoint) in copies[0]["mounts"], left
    except BaseException:
        print(run.output()[-8000:])
        sick.heal()
        sick_tier.heal()
        if run.proc.poll() is None:
            run.proc.kill()
        raise
    sick_tier.close()
    healed_end(sick, stuck)


@pytest.mark.soak
def test_checkpoint_dir_hung_every_call_excludes_the_node(tmp_path: Path, sick: SickFs,
                                                         request: pytest.FixtureRequest) -> None:
    """Every call on the checkpoint mount hangs (an NFS server gone), rlsup's own reads of it included: the
    same verdict, reached while rlsup's single-file watcher is stalled on the mount too. With the soak: one
    whole-suite run under load (2026-11-27) saw a stuck rank's file or mount named otherwise (its record is
    printed whole now), not yet understood."""
    if not request.config.getoption("--soak", default=None):
        pytest.skip("soak: pass --soak MINUTES")
    hung_save_ends_unkillable(tmp_path, sick, {})


def newest_local_step(ckpt: Path) -> int:
    found = latest_valid(ckpt, full=False) if ckpt.exists() else None
    return found.step if found is not None and found.step is not None else -1


def test_persistent_tier_hung_training_goes_on_and_the_copy_is_named(tmp_path: Path, sick: SickFs) -> None:
    """The persistent tier's mount hangs its writes and flushes: the tier's copy stalls in its own thread, in a write
    of a tier file, and is named (the mount, the step and rank it was copying) while training, heartbeats and the
    run loop go on; a rank's crash restarts from the local step without reading the hung tier, its launch's fork
    not held by the file the copy holds open (each close sends a flush); a stop
    ends the run (state ``stopped``) without waiting on the stalled pass, the final copy skipped and named (the
    pass, a forked child, is left in the mount: rlsup's exit does not wait for it)."""
    ckpt, state_dir = tmp_path / "ckpt", tmp_path / ".rlsup"
    run = Supervised.start(tmp_path, [*FAST, "--checkpoint-dir", str(ckpt), "--persistent-dir", str(sick.mountpoint),
                                      "--heartbeat-timeout", "30", "--stop-grace", "5",
                                      "--kill-grace", "2", *LEAN],
                           torchrun("--steps", "5000", "--checkpoint-every", "2", "--step-time", "0.02", ranks=1),
                           clean_env(OMP_NUM_THREADS="1", TORCH_FR_BUFFER_SIZE="0"))
    try:
        wait_for(lambda: "copied to the persistent tier" in run.output(), 90, "a first persistent copy")
        sick.hang(ops=("write", "flush"))  # the copy thread held in a write, its file open: a fork must still exec
        wait_for(lambda: sick.status()["held"], 30, "the tier's next write held by the hung mount")
        stall = wait_for(lambda: next((line for line in run.output().splitlines() if "not answering" in line), None),
                         40, "the stalled tier copy named")
        assert "rlsup-persistent-tier" in stall and str(sick.mountpoint) in stall, stall
        at_stall = newest_local_step(ckpt)
        wait_for(lambda: newest_local_step(ckpt) >= at_stall + 6, 60, "training to go on past the hung tier")
        seen = json.loads((state_dir / "state.json").read_text()).get("last_step") or 0
        wait_for(lambda: (json.loads((state_dir / "state.json").read_text()).get("last_step") or 0) > seen + 5, 30,
                 "the run loop to record the ranks' new heartbeats")
        # The rank dies: the restart (rlsup's fork of torchrun, no warm launcher) chooses its resume without the
        # hung tier, from this node's disk.
        hb = run.state_dir / "attempts" / "attempt_0000" / "heartbeats" / rank_file_name(0)
        os.kill(read_record(hb).pid, signal.SIGKILL)
        launch = wait_for(lambda: next((line for line in run.output().splitlines() if "attempt 1: launching" in line),
                                       None), 60, "the restart after the rank's death")
        assert "persistent tier not consulted for the resume" in run.output()
        assert re.search(rf"from step \d+ \({re.escape(str(ckpt))}/step_", launch), launch
        assert run.attempt() == 1 and not run.ended()
        run.proc.send_signal(signal.SIGTERM)  # a stop with the tier still hung: never waits on the stalled pass
        wait_for(lambda: json.loads((state_dir / "state.json").read_text())["state"] == "stopped", 120,
                 "the run to stop while the tier is hung")
        wait_for(lambda: "final persistent copy skipped" in run.output(), 30, "the skipped final copy named")
    except BaseException:
        print(run.output()[-8000:])  # rlsup's side of the failure (pytest shows it with the failure)
        raise
    finally:
        sick.heal()  # the stalled pass (rlsup's forked child) gets its answer
        try:
            run.proc.wait(60)
        finally:
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait(10)
    assert run.proc.returncode == 128 + signal.SIGTERM, run.output()[-3000:]



def test_persistent_tier_hung_at_the_restart_resumes_this_nodes_step(tmp_path: Path, sick: SickFs) -> None:
    """The persistent tier's mount hangs (every call) and a rank dies at once, before the tier's pass is named stalled: the
    restart's resume choice reads the tier in a bounded call (10 s without progress), names the tier and resumes
    this node's own newest step from its disk; training goes on in attempt 1. The metric
    ``rlsup_tier_stalled{tier="persistent"}`` reads 1 meanwhile."""
    ckpt, (port,) = tmp_path / "ckpt", free_ports(1)
    run = Supervised.start(tmp_path, [*FAST, "--checkpoint-dir", str(ckpt), "--persistent-dir", str(sick.mountpoint),
                                      "--heartbeat-timeout", "30", "--stop-grace", "5", "--kill-grace", "2",
                                      "--metrics-addr", "127.0.0.1", *LEAN],
                           torchrun("--steps", "5000", "--checkpoint-every", "2", "--step-time", "0.02", ranks=1),
                           clean_env(OMP_NUM_THREADS="1", TORCH_FR_BUFFER_SIZE="0", RLSUP_METRICS_PORT=str(port)))
    try:
        wait_for(lambda: "copied to the persistent tier" in run.output(), 90, "a first persistent copy")
        hb = run.state_dir / "attempts" / "attempt_0000" / "heartbeats" / rank_file_name(0)
        pid = read_record(hb).pid
        sick.hang()  # every call, flush included: a server gone
        os.kill(pid, signal.SIGKILL)  # the restart's resume choice meets the tier hung
        launch = wait_for(lambda: next((line for line in run.output().splitlines() if "attempt 1: launching" in line),
                                       None), 90, "the restart with the tier hung")
        assert "persistent tier not consulted for the resume" in run.output(), run.output()[-3000:]
        assert re.search(rf"from step \d+ \({re.escape(str(ckpt))}/step_", launch), launch
        resumed = int(re.search(r"from step (\d+)", launch).group(1))
        wait_for(lambda: newest_local_step(ckpt) > resumed + 4, 90, "attempt 1 to train on past the hung tier")
        wait_for(lambda: value(parse(try_scrape(port) or ""), "rlsup_tier_stalled", tier="persistent") == 1, 30,
                 "the stalled tier in rlsup's metrics")
        assert run.attempt() == 1 and not run.ended()
    except BaseException:
        print(run.output()[-8000:])
        raise
    finally:
        sick.heal()
        run.proc.send_signal(signal.SIGTERM)
        try:
            run.proc.wait(60)
        finally:
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait(10)


def popen_returns(within: float) -> bool:
    """Whether ``Popen(["true"])`` from this process returns and its child ends within ``within`` seconds (a fork
    whose child closes an inherited descriptor on a hung mount at exec does not)."""
    import subprocess
    import threading

    done = threading.Event()
    threading.Thread(target=lambda: (subprocess.Popen(["true"]).wait(), done.set()), daemon=True).start()
    return done.wait(within)


def test_a_tier_copy_held_in_a_write_never_holds_a_fork(tmp_path: Path, sick: SickFs) -> None:
    """The tier's copy thread is held in a write of a tier file (flush held too, as on a dead NFS server): a
    fork of this process still execs, since the tier's files are open in a descriptor table of the tier's
    threads only (supervisor/tiers/private_files.py); the pass is named stalled. In process, a real tier."""
    from supervisor.tiers.persistent import PersistentTier

    ckpt = tmp_path / "ckpt"
    step_dir = ckpt / step_dir_name(2)
    step_dir.mkdir(parents=True)
    data = bytes(range(256)) * 4096
    (step_dir / "rank_00000.pt").write_bytes(data)
    entry = copy_hashing(io.BytesIO(data))
    manifest = RankManifest(SCHEMA_VERSION, 2, 1, 0, "test", {"rank_00000.pt": entry}, 1.0)
    (step_dir / manifest_name(0)).write_text(manifest.to_json())
    tier = PersistentTier(sick.mountpoint / "tier", source=ckpt)
    sick.hang(ops=("write", "flush"))
    tier.start()
    try:
        wait_for(lambda: sick.status()["held"], 30, "the tier's write held by the hung mount")
        assert popen_returns(30), "a fork blocked on the tier's file held open on the hung mount"
        wait_for(tier.stalled, 40, "the stalled copy named (10 s)")
        assert "copying step 2 rank 0" in tier.stalled(), tier.stalled()
    finally:
        sick.heal()
        tier.stop(30)
