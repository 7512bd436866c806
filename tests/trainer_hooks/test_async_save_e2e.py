"""The end-to-end half of test_async_save.py (real processes, or waits on real time):
checkpointManager(async_save=True): short blocking, a true snapshot, flush on wait/atexit/preemption, and SIGKILL
of the trainer or of the writer process never leaves a valid-looking partial checkpoint."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from support.env import ROOT, clean_env
from support.procs import pid_alive
from support.waits import wait_for
from trainer_hooks import CheckpointManager
from trainer_hooks.async_writer import AsyncSaveError
from rlsup_format.manifest import list_step_dirs, read_manifest, step_dir_name, verify_step_dir


def big_state(mb: int = 100) -> dict:
    n = mb * 2**20 // 4 // 2
    return {"model": {"w": torch.randn(n), "b": torch.zeros(7)}, "optim": {"m": torch.randn(n)},
            "meta": {"epoch": 3, "lr": [0.1, 0.2]}}


def loaded(step_dir: Path) -> dict:
    return torch.load(step_dir / "rank_00000.pt", weights_only=True)


def test_save_returns_before_the_write_and_the_copy_is_a_snapshot(tmp_path: Path) -> None:
    """The blocking part of an async save is the copy alone: with the writer process stopped (SIGSTOP), save()
    still returns, the step is not valid yet, and an in-place update made at once does not reach the file.
    (How much shorter than a synchronous save it blocks is a figure: benchmarks/run.py --only save.)"""
    state = big_state(100)
    sync = CheckpointManager(tmp_path / "sync")
    sync.save(1, state)
    mgr = CheckpointManager(tmp_path / "async", async_save=True)
    try:
        for step in (1, 2):
            expect_w = state["model"]["w"].clone()
            writer = mgr._async.writer_pid if step == 2 else None  # stopped for the second save
            if writer is not None:
                os.kill(writer, signal.SIGSTOP)
            saved: list[Path] = []
            try:
                saver = threading.Thread(target=lambda: saved.append(mgr.save(step, state)), daemon=True)
                saver.start()
                saver.join(timeout=60)
                assert saved, f"save({step}) did not return in 60 s" + (" with its writer stopped" if writer else "")
                state["model"]["w"].add_(1.0)  # the next optimizer step changes the tensors in place at once
                state["meta"]["lr"].append(9.9)
                if writer is not None:
                    assert not verify_step_dir(saved[0]).valid, "a step counted valid while its writer was stopped"
            finally:
                if writer is not None:
                    os.kill(writer, signal.SIGCONT)  # a failed check above must not leave it stopped
            assert mgr.wait(timeout=60)
            assert verify_step_dir(saved[0]).valid
            got = loaded(saved[0])
            assert torch.equal(got["model"]["w"], expect_w), "the checkpoint saw a later in-place update"
            assert torch.equal(got["optim"]["m"], state["optim"]["m"]) and got["meta"]["lr"][-1] != 9.9 or step == 2
    finally:
        mgr.close()
    # The same bytes as a synchronous save would hold (RNG aside): loads like one.
    a, s = loaded(tmp_path / "async" / step_dir_name(1)), loaded(tmp_path / "sync" / step_dir_name(1))
    assert a.keys() == s.keys() and torch.equal(a["optim"]["m"], s["optim"]["m"])
    assert read_manifest(tmp_path / "async" / step_dir_name(1) / "manifest.rank_00000.json").extra["writer_pid"]


def test_busy_skip_wait_and_writer_killed(tmp_path: Path) -> None:
    state = big_state(64)
    mgr = CheckpointManager(tmp_path / "c", async_save=True, when_busy="skip", keep_last=2)
    try:
        mgr.save(1, {"x": torch.ones(3)})
        assert mgr.wait(timeout=60) and verify_step_dir(tmp_path / "c" / step_dir_name(1)).valid
        assert mgr.save(2, state) is not None
        assert mgr.save(3, state) is None  # step 2 still in flight: skipped
        os.kill(mgr._async.writer_pid, signal.SIGKILL)  # mid-write
        with pytest.raises(AsyncSaveError, match="writer process died"):
            mgr.wait(timeout=60)
        assert not verify_step_dir(tmp_path / "c" / step_dir_name(2)).valid
        assert verify_step_dir(tmp_path / "c" / step_dir_name(1)).valid  # older ones untouched
        assert mgr.save(4, {"x": torch.ones(3)}) is not None  # a new writer takes over
        assert mgr.wait(timeout=60)
        assert verify_step_dir(tmp_path / "c" / step_dir_name(4)).valid
    finally:
        mgr.close()
    waiter = CheckpointManager(tmp_path / "w", async_save=True, when_busy="wait")
    try:
        waiter.save(1, state)
        waiter.save(2, state)  # waits for step 1's write, then returns
        assert waiter.wait(timeout=60)
        assert [s for s, _ in list_step_dirs(tmp_path / "w")] == [1, 2]
        assert all(verify_step_dir(p).valid for _, p in list_step_dirs(tmp_path / "w"))
    finally:
        waiter.close()


FLUSH_JOB = r"""
import os, signal, sys
sys.path.insert(0, os.environ["RLSUP_ROOT"])
import torch
from trainer_hooks import CheckpointManager, should_stop
mode, directory = sys.argv[1], sys.argv[2]
mgr = CheckpointManager(directory, async_save=True)
state = {"w": torch.full((8 * 2**20,), 5.0)}
if mode == "preempt":
    should_stop()                       # installs the SIGTERM handler, as under rlsup
    os.kill(os.getpid(), signal.SIGTERM)
    assert should_stop()
    mgr.save(5, state)                  # preemption: returns only once step 5 is on disk
    os._exit(0)                         # no atexit, no wait()
mgr.save(5, state)
sys.exit(0)                             # no wait(): the atexit hook flushes
"""


def test_atexit_and_preemption_flush(tmp_path: Path) -> None:
    script = tmp_path / "flush_job.py"
    script.write_text(FLUSH_JOB)
    env = clean_env(RLSUP_ROOT=str(ROOT))
    procs = {mode: subprocess.Popen([sys.executable, str(script), mode, str(tmp_path / mode)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for mode in ("atexit", "preempt")}
    for mode, proc in procs.items():
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, (mode, out[-2000:])
        step_dir = tmp_path / mode / step_dir_name(5)
        assert verify_step_dir(step_dir).valid, mode
        assert bool((loaded(step_dir)["w"] == 5.0).all())


KILL_JOB = r"""
import os, sys, time
sys.path.insert(0, os.environ["RLSUP_ROOT"])
import torch
from trainer_hooks import CheckpointManager
from trainer_hooks.async_writer import AsyncSaveError
mgr = CheckpointManager(sys.argv[1], async_save=True, keep_last=3)
n = 3 * 2**20
state = {"w": torch.zeros(n), "v": torch.zeros(n), "step": 0}
step = mgr.restore(state)
print("start", step, flush=True)
while True:
    step += 1
    state["w"].fill_(step); state["v"].fill_(-step); state["step"] = step   # in place, as training does
    try:
        mgr.save(step, state)
    except AsyncSaveError as e:
        print("save failed:", e, flush=True)
    time.sleep(0.01)
"""


def check_consistent(ckpt: Path) -> set[int]:
    """Every step that verifies holds exactly that step's state (no torn or mixed snapshot)."""
    valid = set()
    for step, path in list_step_dirs(ckpt):
        if not verify_step_dir(path).valid:
            continue
        try:
            d = loaded(path)
        except FileNotFoundError:  # the live trainer's keep_last removed it after it verified
            continue
        assert d["step"] == step and bool((d["w"] == step).all()) and bool((d["v"] == -step).all()), step
        valid.add(step)
    return valid


def writer_of(pid: int) -> int | None:
    try:
        kids = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return None
    for k in kids:
        try:
            if "trainer_hooks.async_writer" in " ".join(k.cmdline()) and k.status() != psutil.STATUS_ZOMBIE:
                return k.pid
        except psutil.NoSuchProcess:
            continue
    return None


def staging_exists(ckpt: Path) -> bool:
    try:
        return any(e.name.startswith(".staging-") for _, p in list_step_dirs(ckpt) for e in os.scandir(p))
    except FileNotFoundError:
        return False


def test_sigkill_trainer_or_writer_never_leaves_a_valid_partial(tmp_path: Path) -> None:
    script = tmp_path / "kill_job.py"
    script.write_text(KILL_JOB)
    ckpt = tmp_path / "ckpt"
    env = clean_env(RLSUP_ROOT=str(ROOT))
    rng = random.Random(20261124)
    for round_ in range(2):
        before = check_consistent(ckpt)
        proc = subprocess.Popen([sys.executable, str(script), str(ckpt)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            wait_for(lambda: writer_of(proc.pid), 60, "the writer process")
            newest_before = max(before, default=0)
            wait_for(lambda: max(check_consistent(ckpt), default=0) > newest_before, 60, "a new valid step")
            for kill in range(3 if round_ == 0 else 0):  # the writer, at random moments and once mid-write
                writer = wait_for(lambda: writer_of(proc.pid), 60, "a (new) writer process")
                if kill == 0:
                    wait_for(lambda: staging_exists(ckpt), 30, "a write in progress", interval=0.001)
                else:
                    time.sleep(rng.uniform(0.0, 0.4))
                os.kill(writer, signal.SIGKILL)
                wait_for(lambda: not pid_alive(writer), 10, "the killed writer to go")
                valid = check_consistent(ckpt)
                assert max(valid) >= newest_before
            good = check_consistent(ckpt)
            wait_for(lambda: writer_of(proc.pid) and check_consistent(ckpt) - good, 60,
                     "training and saving to go on after the writer kills")
            writer = writer_of(proc.pid)
            if round_ == 0:
                wait_for(lambda: staging_exists(ckpt), 30, "a write in progress", interval=0.001)
            else:
                time.sleep(rng.uniform(0.0, 0.4))
            newest = max(check_consistent(ckpt))
            os.kill(proc.pid, signal.SIGKILL)  # the trainer
            proc.wait(timeout=10)
            if writer:
                wait_for(lambda: not pid_alive(writer), 10, "the writer to die with its trainer")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        after = check_consistent(ckpt)
        assert newest in after or max(after) > newest  # the newest valid one stays (keep_last never drops it)
        out = proc.stdout.read() if proc.stdout else ""
        if round_ == 0:
            assert "save failed" in out, out[-2000:]  # the writer kills were reported, not silent


def test_the_writer_starts_with_the_manager_and_writes_the_first_save(tmp_path: Path) -> None:
    """The writer's interpreter and torch import overlap the trainer's restore: started on the first save, they
    made the second save of every attempt wait (8-15 s on loaded cores, BENCHMARKS.md)."""
    mgr = CheckpointManager(tmp_path / "c", async_save=True)
    try:
        writer = mgr._async.writer_pid
        assert writer is not None and pid_alive(writer), "no writer process before the first save"
        step_dir = mgr.save(1, {"x": torch.ones(3)})
        assert step_dir is not None and mgr.wait(timeout=60)
        assert read_manifest(step_dir / "manifest.rank_00000.json").extra["writer_pid"] == writer
    finally:
        mgr.close()
    assert not pid_alive(writer), "close() leaves the writer running"


def _guarded(pid: int) -> str | None:
    """"gone" once the process died; its memory map once it ignores SIGTERM; else None."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        maps = Path(f"/proc/{pid}/maps").read_text()
    except FileNotFoundError:
        return "gone"
    fields = dict(ln.split(":", 1) for ln in status.splitlines() if ":" in ln)
    if fields["State"].strip().startswith("Z"):
        return "gone"
    return maps if int(fields["SigIgn"], 16) >> (signal.SIGTERM - 1) & 1 else None


def test_the_writer_ignores_relayed_signals_from_its_start(tmp_path: Path) -> None:
    """Started with the manager, the writer spends its first seconds starting Python and importing torch, during
    the trainer's restore: a SIGTERM that rlsup relays to the job then must not kill it. It is sent here the moment
    the writer exists; the writer ignores it before torch's import (blocked until then)."""
    assert _guarded(os.getpid()) is None, "this test process ignores SIGTERM: the writer would inherit that"
    mgr = CheckpointManager(tmp_path / "c", async_save=True)
    try:
        writer = mgr._async.writer_pid
        os.kill(writer, signal.SIGTERM)
        maps = wait_for(lambda: _guarded(writer), 60, "the writer to ignore SIGTERM", interval=0.0005)
        assert maps != "gone", "a SIGTERM at the writer's start killed it"
        assert "libtorch" not in maps, "the writer ignored SIGTERM only once torch was imported"
        step_dir = mgr.save(1, {"x": torch.ones(3)})
        assert step_dir is not None and mgr.wait(timeout=60)
        assert read_manifest(step_dir / "manifest.rank_00000.json").extra["writer_pid"] == writer
    finally:
        mgr.close()


def test_closing_a_manager_that_never_saved_does_not_wait_for_its_writer(tmp_path: Path) -> None:
    """A trainer that stops (or fails) before its first save: the writer, perhaps still importing torch, wrote
    nothing and is ended at once, not waited for (up to 30 s, past rlsup's stop grace). Stopped here, it could
    never answer a stop request."""
    mgr = CheckpointManager(tmp_path / "c", async_save=True)
    writer = mgr._async.writer_pid
    os.kill(writer, signal.SIGSTOP)
    closer = threading.Thread(target=mgr.close, daemon=True)
    closer.start()
    closer.join(timeout=10)
    assert not closer.is_alive(), "close() waited for a writer that never wrote"
    assert not pid_alive(writer)


FORK_JOB = """
import os, sys
sys.path.insert(0, os.environ["RLSUP_ROOT"])
import torch
from trainer_hooks import CheckpointManager
mgr = CheckpointManager(sys.argv[1], async_save=True)
writer = mgr._async.writer_pid
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a forked helper that exits normally: its atexit hooks run
os.waitpid(pid, 0)
step_dir = mgr.save(1, {"x": torch.ones(3)})
mgr.wait(timeout=60)
print("writer", writer, mgr._async.writer_pid, flush=True)
mgr.close()
"""


def test_a_forked_child_leaves_the_trainers_writer_alone(tmp_path: Path) -> None:
    """A process forked from the trainer after the manager was built (a DataLoader worker, a helper) that exits
    normally must not stop or kill the trainer's writer from its atexit flush."""
    script = tmp_path / "fork_job.py"
    script.write_text(FORK_JOB)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "c")], env=clean_env(RLSUP_ROOT=str(ROOT)),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    _, before, after = out.stdout.split()
    assert before == after, "the trainer's writer was ended by its forked child"
    assert verify_step_dir(tmp_path / "c" / step_dir_name(1)).valid

