"""CheckpointManager: exact resume, retention safety, same-step rules, and SIGKILL at random moments."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from trainer_hooks.checkpoint import CheckpointManager
from rlsup_format.manifest import (
    is_held,
    list_step_dirs,
    manifest_name,
    step_dir_name,
    verify_step_dir,
)
from trainer_hooks.sampler import ResumableSampler


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


@pytest.mark.parametrize(("backend", "problem"), [("torch", r"manifest.rank_00000.json"), ("dcp", "no manifests")])
def test_resume_dir_named_by_rlsup_is_loaded_or_fails_loudly(tmp_path, monkeypatch, backend, problem):
    """rlsup's choice is binding: the named step, "" for a fresh start, never another step quietly. dcp too (a
    collective backend, its step checked whole by rank 0): found by the shrink's FSDP test, a valid step's verdict
    ("ok") was taken for the problem there, so every dcp resume under rlsup failed."""
    from trainer_hooks.checkpoint import ResumeError

    ckpt = CheckpointManager(tmp_path, backend=backend)
    for step in (1, 2):
        ckpt.save(step, {"v": step})
    monkeypatch.setenv("RLSUP_CHECKPOINT_DIR", str(tmp_path))
    monkeypatch.setenv("RLSUP_RESUME_DIR", str(tmp_path / step_dir_name(1)))
    monkeypatch.setenv("RLSUP_RESUME_STEP", "1")
    state = {"v": 0}
    assert ckpt.restore(state) == 1 and state["v"] == 1
    (tmp_path / step_dir_name(1) / manifest_name(0)).unlink()
    with pytest.raises(ResumeError, match=r"rank 0 cannot load the step rlsup named .*step_000000001.*" + problem):
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


# ------------------------------------------------------------ a full disk says so (issue #9)
