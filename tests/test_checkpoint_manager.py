"""CheckpointManager: exact resume, retention safety, same-step rules, and SIGKILL at random moments."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from trainer_hooks.checkpoint import CheckpointManager
from rlsup_format.manifest import (
    is_held,
    latest_valid,
    list_step_dirs,
    manifest_name,
    step_dir_name,
    verify_step_dir,
)
from trainer_hooks.sampler import ResumableSampler
from rlsup_format.names import host_tag

REPO = Path(__file__).resolve().parents[1]


class Squares(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4) / (n * 4)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


def make_job():
    """A tiny but complete training job: every kind of state the manager must carry."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)
    # Each loader gets its own generator: DataLoader draws a base seed whenever an iterator is
    # created, and a resumed run creates iterators at other moments than the uninterrupted one.
    sdl = StatefulDataLoader(Squares(10), batch_size=3, sampler=ResumableSampler(10, 1, 0, seed=7),
                             generator=torch.Generator())  # 4 batches per epoch, sampler saved by the loader
    sampler = ResumableSampler(8, 1, 0, seed=4)
    plain = DataLoader(Squares(8), batch_size=2, sampler=sampler, generator=torch.Generator())  # 4 per epoch
    state = {"model": model, "optim": optim, "sched": sched, "sdl": sdl, "sampler": sampler, "tokens": 0}
    return state, plain


def batches(state, plain):
    """Endless (sdl batch, plain batch) pairs, following the documented epoch loop."""
    def epochs(loader, s):
        while True:
            s.set_epoch(s.epoch)  # keeps a restored position
            yield from loader
            s.set_epoch(s.epoch + 1)

    return zip(epochs(state["sdl"], state["sdl"].sampler), epochs(plain, state["sampler"]))


def train(state, plain, steps):
    losses = []
    stream = batches(state, plain)
    for _ in range(steps):
        a, b = next(stream)
        noise = torch.randn(1) * 1e-3 + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
        loss = state["model"](torch.cat([a, b])).pow(2).mean() + noise
        state["optim"].zero_grad()
        loss.backward()
        state["optim"].step()
        state["sched"].step()
        state["tokens"] += len(a) + len(b)
        losses.append(loss.item())
    return losses


def draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


@pytest.mark.parametrize("backend", ["torch", "dcp"])
@pytest.mark.parametrize("split", [4, 6])  # 4: both samplers are exactly at an epoch boundary
def test_round_trip_matches_uninterrupted_run(tmp_path, backend, split):
    random.seed(11)
    np.random.seed(11)
    state, plain = make_job()
    full = train(state, plain, 10)
    full_weights = [p.detach().clone() for p in state["model"].parameters()]
    full_tokens, full_draws = state["tokens"], draws()

    random.seed(11)
    np.random.seed(11)
    state, plain = make_job()
    first = train(state, plain, split)
    ckpt = CheckpointManager(tmp_path, backend=backend)
    ckpt.save(split, state)
    random.seed(999)  # the crashed process's RNGs are gone; a fresh process starts elsewhere
    np.random.seed(999)
    torch.manual_seed(999)

    state, plain = make_job()
    assert CheckpointManager(tmp_path, backend=backend).restore(state) == split
    rest = train(state, plain, 10 - split)
    assert first + rest == full
    assert state["tokens"] == full_tokens
    for p, q in zip(state["model"].parameters(), full_weights):
        assert torch.equal(p, q)
    assert draws() == full_draws


def test_restore_without_checkpoint_returns_zero(tmp_path):
    state = {"x": 1}
    assert CheckpointManager(tmp_path).restore(state) == 0 and state == {"x": 1}


def test_directory_from_env_or_error(tmp_path, monkeypatch):
    monkeypatch.delenv("RLSUP_CHECKPOINT_DIR", raising=False)
    with pytest.raises(ValueError, match="RLSUP_CHECKPOINT_DIR"):
        CheckpointManager()
    monkeypatch.setenv("RLSUP_CHECKPOINT_DIR", str(tmp_path))
    assert CheckpointManager().directory == tmp_path


def test_unknown_backend(tmp_path):
    with pytest.raises(ValueError, match="unknown checkpoint backend"):
        CheckpointManager(tmp_path, backend="nope")


def test_safe_globals_allow_list(tmp_path):
    from collections import namedtuple

    Point = namedtuple("Point", "x y")  # not loadable under weights_only unless allow-listed
    globals()["Point"] = Point
    Point.__module__ = __name__
    CheckpointManager(tmp_path).save(1, {"p": Point(1, 2)})
    with pytest.raises(Exception, match="weights_only"):
        CheckpointManager(tmp_path).restore({"p": None})
    state = {"p": None}
    CheckpointManager(tmp_path, safe_globals=[Point]).restore(state)
    assert state["p"] == Point(1, 2)


def valid_steps(directory):
    return [s for s, p in list_step_dirs(directory) if verify_step_dir(p).valid]


def test_keep_last_keeps_newest_and_skips_invalid(tmp_path):
    ckpt = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        ckpt.save(step, {"v": step})
    assert [s for s, _ in list_step_dirs(tmp_path)] == [2, 3]
    (tmp_path / step_dir_name(3) / "rank_00000.pt").write_bytes(b"corrupt")  # newest becomes invalid
    ckpt.save(4, {"v": 4})
    # step 3 is invalid and older than the new valid step: removed; 2 and 4 are the two kept valid ones.
    assert [s for s, _ in list_step_dirs(tmp_path)] == [2, 4]
    ckpt1 = CheckpointManager(tmp_path, keep_last=1)
    ckpt1.save(5, {"v": 5})
    assert valid_steps(tmp_path) == [5]


def test_keep_last_never_deletes_held_or_resume_step(tmp_path, monkeypatch):
    ckpt = CheckpointManager(tmp_path, keep_last=1)
    for step in (1, 2):
        ckpt.save(step, {"v": step})
    assert valid_steps(tmp_path) == [2]
    (tmp_path / step_dir_name(2) / ".hold-replication").touch()
    monkeypatch.setenv("RLSUP_RESUME_DIR", str(tmp_path / step_dir_name(2)))
    ckpt.save(3, {"v": 3})
    ckpt.save(4, {"v": 4})
    assert valid_steps(tmp_path) == [2, 4] and is_held(tmp_path / step_dir_name(2))
    (tmp_path / step_dir_name(2) / ".hold-replication").unlink()
    ckpt.save(5, {"v": 5})
    assert valid_steps(tmp_path) == [2, 5]  # still the resume step
    monkeypatch.delenv("RLSUP_RESUME_DIR")
    ckpt.save(6, {"v": 6})
    assert valid_steps(tmp_path) == [6]


def test_retention_waits_while_new_step_incomplete(tmp_path, monkeypatch):
    ckpt = CheckpointManager(tmp_path, keep_last=1)
    ckpt.save(1, {"v": 1})
    monkeypatch.setenv("WORLD_SIZE", "2")  # rank 1 has not written step 2 yet
    CheckpointManager(tmp_path, keep_last=1).save(2, {"v": 2})
    assert valid_steps(tmp_path) == [1] and (tmp_path / step_dir_name(1)).exists()
    monkeypatch.setenv("RANK", "1")
    CheckpointManager(tmp_path, keep_last=1).save(2, {"v": 2})  # rank 1 completes step 2
    assert valid_steps(tmp_path) == [1, 2]  # only rank 0 runs retention
    monkeypatch.setenv("RANK", "0")
    CheckpointManager(tmp_path, keep_last=1).save(2, {"v": 2})  # rank 0's next save: part valid, prunes
    assert valid_steps(tmp_path) == [2] and not (tmp_path / step_dir_name(1)).exists()


def test_resume_dir_named_by_rlsup_is_loaded_or_fails_loudly(tmp_path, monkeypatch):
    """rlsup's choice is binding: the named step, "" for a fresh start, never another step quietly."""
    from trainer_hooks.checkpoint import ResumeError

    ckpt = CheckpointManager(tmp_path)
    for step in (1, 2):
        ckpt.save(step, {"v": step})
    monkeypatch.setenv("RLSUP_CHECKPOINT_DIR", str(tmp_path))
    monkeypatch.setenv("RLSUP_RESUME_DIR", str(tmp_path / step_dir_name(1)))
    monkeypatch.setenv("RLSUP_RESUME_STEP", "1")
    state = {"v": 0}
    assert ckpt.restore(state) == 1 and state["v"] == 1
    (tmp_path / step_dir_name(1) / manifest_name(0)).unlink()
    with pytest.raises(ResumeError, match=r"rank 0 cannot load the step rlsup named .*step_000000001.*manifest.rank_00000.json"):
        ckpt.restore(state)  # before: it quietly took step 2
    monkeypatch.setenv("RLSUP_RESUME_DIR", "")  # rlsup decided: fresh start (e.g. every step was another job's)
    state = {"v": 0}
    assert ckpt.restore(state) == 0 and state["v"] == 0
    monkeypatch.delenv("RLSUP_RESUME_DIR")  # outside rlsup: the newest valid step
    assert ckpt.restore(state) == 2 and state["v"] == 2


def test_resume_step_must_match_the_named_one(tmp_path, monkeypatch):
    from trainer_hooks.checkpoint import ResumeError

    ckpt = CheckpointManager(tmp_path)
    ckpt.save(3, {"v": 3})
    monkeypatch.setenv("RLSUP_RESUME_DIR", str(tmp_path / step_dir_name(3)))
    monkeypatch.setenv("RLSUP_RESUME_STEP", "4")
    with pytest.raises(ResumeError, match="rlsup named step 4"):
        ckpt.restore({"v": 0})


def test_save_over_invalid_same_step_replaces_it(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    d = ckpt.save(7, {"v": "old"})
    (d / "rank_00000.pt").write_bytes(b"torn")
    assert not verify_step_dir(d).valid
    ckpt.save(7, {"v": "new"})
    assert verify_step_dir(d).valid
    state = {"v": None}
    assert ckpt.restore(state) == 7 and state["v"] == "new"


def test_valid_same_step_is_not_touched(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    d = ckpt.save(7, {"v": "first"})
    before = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    ckpt.save(7, {"v": "second"})
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == before
    state = {"v": None}
    ckpt.restore(state)
    assert state["v"] == "first"


def test_leftovers_of_dead_saves_are_cleaned(tmp_path):
    ckpt = CheckpointManager(tmp_path)
    d = ckpt.save(1, {"v": 1})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    here = host_tag()  # leftover names say host and pid (rlsup_format.names)
    stale = d / f".staging-rank_00000-{here}-{dead.pid}-0a0a0a0a"
    stale.mkdir()
    (stale / "rank_00000.pt").write_bytes(b"partial")
    tmp_manifest = d / f".tmp-manifest.rank_00000.json-{here}-{dead.pid}-0b0b0b0b"
    tmp_manifest.write_text("{")
    # Not ours to judge: another rank's on another host (its pid means nothing here, and it is young),
    # and a live writer's on this host (a save under way).
    other_rank = d / f".staging-rank_00001-otherhost-{dead.pid}-0c0c0c0c"
    other_rank.mkdir()
    live = d / f".staging-rank_00001-{here}-{os.getppid()}-0d0d0d0d"
    live.mkdir()
    ckpt.save(2, {"v": 2})
    assert not stale.exists() and not tmp_manifest.exists() and other_rank.exists() and live.exists()
    assert verify_step_dir(d).valid


CHILD = textwrap.dedent("""
    import sys, torch
    from trainer_hooks.checkpoint import CheckpointManager
    ckpt = CheckpointManager(sys.argv[1], keep_last=2)
    state = {"w": torch.zeros(1_000_000), "step": 0}
    step = ckpt.restore(state)
    assert state["step"] == step and bool((state["w"] == step).all()), "restored state does not match its step"
    print("restored", step, flush=True)
    while True:
        step += 1
        state["w"].fill_(step)
        state["step"] = step
        ckpt.save(step, state)
        print("saved", step, flush=True)
""")


def read_line(proc, deadline):
    """Next stdout line of ``proc`` or None at the deadline (no bare sleeps)."""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if ready:
            return proc.stdout.readline()
    return None


def test_sigkill_at_random_moments_never_loses_a_valid_checkpoint(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    ckpt_dir = tmp_path / "ckpt"
    rng = random.Random(1234)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RLSUP_RESUME_DIR", None)
    last_saved = 0
    invalid_seen = 0
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, str(script), str(ckpt_dir)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
        try:
            line = read_line(proc, time.monotonic() + 60)
            assert line is not None and line.startswith("restored"), (line, proc.stderr.read() if line is None else "")
            assert int(line.split()[1]) == last_saved  # resumes from the newest step it completed
            for _ in range(rng.randint(1, 3)):
                line = read_line(proc, time.monotonic() + 30)
                assert line is not None and line.startswith("saved")
                last_saved = int(line.split()[1])
            # Kill somewhere inside the following save(s): wait a random slice for output, then kill.
            extra = read_line(proc, time.monotonic() + rng.uniform(0.0, 0.06))
            if extra:
                last_saved = int(extra.split()[1])
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            proc.stdout.close()
            proc.stderr.close()
        results = [verify_step_dir(p) for _, p in list_step_dirs(ckpt_dir)]
        invalid_seen += sum(not r.valid for r in results)
        best = latest_valid(ckpt_dir)
        assert best is not None and best.step >= last_saved
        last_saved = best.step
        for r in results:  # every valid step holds exactly its own state
            if r.valid:
                state = {"w": None, "step": None}
                with pytest.MonkeyPatch.context() as mp:
                    mp.setenv("RLSUP_RESUME_DIR", str(r.path))
                    assert CheckpointManager(ckpt_dir).restore(state) == r.step
                assert state["step"] == r.step and bool((state["w"] == r.step).all())
    assert last_saved > 0
    print(f"invalid (killed-mid-save) step dirs observed: {invalid_seen}")


# ------------------------------------------------------------ a full disk says so (issue #9)

def _mount_tmpfs(path: Path, size_kb: int) -> str:
    """Mount a small tmpfs at ``path``: '' on success, else why not (the test then skips)."""
    import shutil as _shutil

    if os.geteuid() != 0 or _shutil.which("mount") is None:
        return "needs root and mount(8) for a small tmpfs"
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)],
                       capture_output=True, text=True)
    return "" if r.returncode == 0 else f"mount -t tmpfs failed: {r.stderr.strip() or r.returncode}"


@pytest.mark.timeout(180)
def test_full_disk_save_error_says_no_space(tmp_path):
    import errno
    import re

    from trainer_hooks.async_writer import AsyncSaveError

    ckpt_dir = tmp_path / "ckpt"
    why = _mount_tmpfs(ckpt_dir, 2048)  # 2 MiB
    if why:
        pytest.skip(why)
    try:
        ckpt = CheckpointManager(ckpt_dir)
        ckpt.save(1, {"w": torch.zeros(1000), "step": 1})  # ~4 KB: fits
        assert verify_step_dir(ckpt_dir / step_dir_name(1)).valid
        big = {"w": torch.zeros(1_000_000), "step": 2}  # 4 MB: cannot fit
        with pytest.raises(RuntimeError) as ei:  # still a RuntimeError, as torch's own error was
            ckpt.save(2, big)
        err = ei.value
        step2 = ckpt_dir / step_dir_name(2)
        m = re.fullmatch(rf"checkpoint save to {re.escape(str(step2))} failed: no space left on device "
                         r"\((\d+) bytes free, step 2 needs about (\d+)\).*", str(err))
        assert m, str(err)
        free, needed = int(m.group(1)), int(m.group(2))
        assert needed >= 4_000_000 and free < needed
        assert isinstance(err, OSError) and err.errno == errno.ENOSPC and err.__cause__ is not None
        # Today's behaviour kept: no staging left, the older valid checkpoint untouched.
        assert not any(p.name.startswith(".staging") for p in step2.iterdir())
        assert not verify_step_dir(step2).valid and latest_valid(ckpt_dir).step == 1
        state = {"w": None, "step": None}
        assert CheckpointManager(ckpt_dir).restore(state) == 1 and state["step"] == 1
        # The asynchronous writer process reports the same clear message.
        actx = CheckpointManager(ckpt_dir, async_save=True)
        try:
            actx.save(3, {"w": torch.zeros(1_000_000), "step": 3})
            with pytest.raises(AsyncSaveError, match="no space left on device"):
                actx.wait(timeout=120)
        finally:
            actx.close()
        assert latest_valid(ckpt_dir).step == 1
    finally:
        subprocess.run(["umount", "-l", str(ckpt_dir)], capture_output=True)
