"""A step saved by W ranks restored into W' ranks (trainer_hooks.world): the sampler's global data position,
the global batch (grad_accum_steps), the resizable mark, and CheckpointManager's world change, in process (ranks
simulated through RANK/WORLD_SIZE; tests/trainer_hooks/test_world_change_e2e.py runs real torchrun)."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest
import torch
from support.datasets import Indices
from torch.utils.data import DataLoader

from rlsup_format import job_env
from rlsup_format.manifest import RESIZABLE, manifest_name, read_manifest, step_dir_name, verify_step_dir
from trainer_hooks.checkpoint import CheckpointManager, ResumeError
from trainer_hooks.sampler import ResumableSampler
from trainer_hooks.world import WorldChange, WorldChangeError, grad_accum_steps, resize_blockers, world_change_seed

# ----------------------------------------------------------------------------------- the sampler


def permutation(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


class World:
    """``size`` ranks, each a ResumableSampler behind a DataLoader, drawing batches in lockstep."""

    def __init__(self, n: int, size: int, batch: int, drop_last: bool, seed: int = 3) -> None:
        self.samplers = [ResumableSampler(n, size, r, seed=seed, drop_last=drop_last) for r in range(size)]
        self.loaders = [iter(DataLoader(Indices(n), batch_size=batch, sampler=s)) for s in self.samplers]

    def step(self) -> list[int] | None:
        """One batch from every rank (None once the epoch is over for all of them)."""
        got = [next(it, None) for it in self.loaders]
        assert len({g is None for g in got}) == 1, "ranks ran out of the epoch at different steps"
        return None if got[0] is None else [int(i) for batch in got for i in batch]

    def rest_of_epoch(self) -> list[int]:
        out: list[int] = []
        while (ids := self.step()) is not None:
            out += ids
        return out


def expected_tail(n: int, start: int, world: int, drop_last: bool, perm: list[int]) -> Counter:
    """What the world that finishes an epoch from ``start`` adds on top of ``perm[:start]``: the rest, padded from
    the epoch's first samples (drop_last=False) or cut to full rounds (drop_last=True)."""
    rest = n - start
    share = rest // world if drop_last else math.ceil(rest / world)
    total = share * world
    tail = perm[start:start + total] if drop_last else perm[start:] + (perm * world)[:total - rest]
    return Counter(tail)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("n, batch, worlds, steps", [
    (60, 2, (3, 2), (4,)),         # 3 -> 2 mid-epoch
    (60, 2, (2, 3), (6,)),         # 2 -> 3 mid-epoch
    (61, 2, (3, 2), (5,)),         # a dataset no world divides: padding / dropping at the tail
    (61, 2, (2, 3), (7,)),
    (23, 1, (4, 3, 5), (2, 3)),    # two changes in one epoch
    (10, 1, (3, 2), (3,)),         # 3 -> 2 in the last round: one sample left for two ranks
    (10, 1, (2, 4), (4,)),         # 2 -> 4 with 2 samples left for 4 ranks
    (17, 2, (1, 4), (3,)),
    (17, 1, (4, 1), (2,)),
])
def test_a_new_world_resumes_the_epoch_at_its_global_position(n, batch, worlds, steps, drop_last):
    seed, epoch = 3, 0
    perm = permutation(n, seed, epoch)
    world, size = World(n, worlds[0], batch, drop_last, seed), worlds[0]
    seen: list[int] = []
    for new_size, k in zip(worlds[1:], steps):
        for _ in range(k):
            ids = world.step()
            assert ids is not None
            seen += ids
        states = [s.state_dict() for s in world.samplers]
        assert len({s["global_position"] for s in states}) == 1
        assert Counter(seen) == Counter(perm[:states[0]["global_position"]])  # the global position is a prefix
        new = World(n, new_size, batch, drop_last, seed)
        for r, sampler in enumerate(new.samplers):
            sampler.load_state_dict(states[r % len(states)])  # any old rank's state: all name the same position
        if new.samplers[0].epoch == 1:  # the epoch ended at the change
            old = world.samplers[0]
            if old.position >= old.remaining():  # the old world had used up its share
                start = old.start
            else:  # the new world's share of the rest is nothing (drop_last, fewer left than ranks)
                start, size = states[0]["global_position"], new_size
            break
        world, size = new, new_size
    else:
        seen += world.rest_of_epoch()
        start = world.samplers[0].start
    assert Counter(seen) == Counter(perm[:start]) + expected_tail(n, start, size, drop_last, perm)
    if not drop_last:
        assert set(seen) == set(range(n))  # every sample at least once; only the padding twice
    else:
        assert max(Counter(seen).values()) == 1  # never a repeat; fewer than W' samples dropped
        assert n - len(seen) < size
    # The next epoch is a whole epoch in the newest world, DistributedSampler's order.
    for s in new.samplers:
        s.set_epoch(1)
    new.loaders = [iter(DataLoader(Indices(n), batch_size=batch, sampler=s)) for s in new.samplers]
    fresh = World(n, worlds[-1], batch, drop_last, seed)
    for s in fresh.samplers:
        s.set_epoch(1)
    fresh.loaders = [iter(DataLoader(Indices(n), batch_size=batch, sampler=s)) for s in fresh.samplers]
    assert new.rest_of_epoch() == fresh.rest_of_epoch()


@pytest.mark.parametrize("old, new", [(3, 2), (2, 3), (4, 1)])
def test_a_state_saved_at_the_end_of_an_epoch_resumes_at_the_next(old, new):
    """At the tail: every rank used up its share (padding included); any world starts the next epoch whole."""
    world = World(11, old, 1, False)
    world.rest_of_epoch()
    state = world.samplers[0].state_dict()
    s = ResumableSampler(11, new, new - 1, seed=3)
    s.load_state_dict(state)
    assert (s.epoch, s.start, s.position) == (1, 0, 0)
    ref = ResumableSampler(11, new, new - 1, seed=3)
    ref.set_epoch(1)
    assert list(s) == list(ref)


def test_same_world_states_stay_as_before():
    """The world that saved loads as it always did, and a state from before world sizes (four keys) still loads."""
    s = ResumableSampler(20, 2, 1, seed=5)
    it = iter(s)
    for _ in range(4):
        next(it)
    state = s.state_dict()
    assert {k: state[k] for k in ("epoch", "seed", "position", "num_samples")} == \
        {"epoch": 0, "seed": 5, "position": 4, "num_samples": 10}
    old_format = {k: state[k] for k in ("epoch", "seed", "position", "num_samples")}
    for saved in (state, old_format):
        t = ResumableSampler(20, 2, 1, seed=5)
        t.load_state_dict(saved)
        assert (t.start, t.position) == (0, 4) and list(t) == s.epoch_indices()[4:]
    with pytest.raises(ValueError, match="samples per rank"):
        ResumableSampler(20, 3, 1, seed=5).load_state_dict(old_format)  # no world size saved: cannot move
    with pytest.raises(ValueError, match="dataset of 20 samples"):
        ResumableSampler(21, 3, 1, seed=5).load_state_dict(state)


def test_a_resumed_share_saved_again_in_the_same_world_keeps_its_start():
    s = ResumableSampler(30, 3, 0, seed=1)
    it = iter(s)
    for _ in range(2):
        next(it)
    moved = ResumableSampler(30, 2, 1, seed=1, count="manual")
    moved.load_state_dict(s.state_dict())
    assert (moved.start, moved.position, moved.remaining()) == (6, 0, 12)
    moved.advance(5)
    again = ResumableSampler(30, 2, 1, seed=1)
    again.load_state_dict(moved.state_dict())
    assert (again.start, again.position, again.global_position) == (6, 5, 16)
    assert list(again) == moved.epoch_indices()[5:]
    moved.advance(100)
    assert moved.position == moved.remaining() == 12  # capped at this rank's share of the rest


# ------------------------------------------------------------------------------ the global batch


@pytest.mark.parametrize("world, accum", [(1, 12), (2, 6), (3, 4), (4, 3), (6, 2), (12, 1)])
def test_grad_accum_steps_keep_the_global_batch(world, accum):
    assert grad_accum_steps(24, 2, world) == accum
    assert accum * 2 * world == 24


def test_grad_accum_steps_refuses_a_world_the_global_batch_cannot_be_split_over():
    with pytest.raises(ValueError, match=r"global batch 24 cannot be split over world size 5 with micro batch 2: "
                                         r"24 is not a multiple of 2 x 5 = 10 \(world sizes up to 5 that fit: 1, 2, 3, 4\)"):
        grad_accum_steps(24, 2, 5)
    with pytest.raises(ValueError, match="global batch 6 cannot be split over world size 4 with micro batch 4"):
        grad_accum_steps(6, 4, 4)
    for bad in ((0, 1, 1), (8, 0, 1), (8, 2, -1), (8.0, 2, 1), (True, 1, 1)):
        with pytest.raises(ValueError, match="must be a positive integer"):
            grad_accum_steps(*bad)


# --------------------------------------------------------------------------------- the mark


def job_state(world: int = 1, rank: int = 0) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)
    sampler = ResumableSampler(24, world, rank, seed=2, count="manual")
    return {"model": model, "optim": optim, "sched": sched, "sampler": sampler, "tokens": 0}


class OwnState:
    """A stateful object of the trainer's own: rlsup cannot tell whether it is the same on every rank."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_what_blocks_the_resizable_mark():
    assert resize_blockers(job_state(), "torch", 3) == []
    assert resize_blockers(job_state(), "dcp", 3) == []
    assert resize_blockers(job_state(), "megatron", 3) == [
        "the 'megatron' backend keeps per-rank state (resizable: torch, dcp)"]
    no_data = {k: v for k, v in job_state().items() if k != "sampler"}
    assert resize_blockers(no_data, "torch", 3) == [
        "no ResumableSampler in the state: the data position could not be carried over"]
    assert resize_blockers({**job_state(), "mine": OwnState()}, "torch", 3) == [
        "'mine' (OwnState) keeps state rlsup cannot judge across world sizes"]
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(Indices(4), sampler=ResumableSampler(4, 1, 0))
    assert "'loader' is a StatefulDataLoader" in resize_blockers({**job_state(), "loader": loader}, "dcp", 2)[0]


def test_sharded_parameters_need_the_dcp_backend(tmp_path):
    """FSDP2 in a one-rank process group: DTensor parameters move only through DCP's resharding."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        state = job_state()
        fully_shard(state["model"])
        assert resize_blockers(state, "dcp", 1) == []
        assert resize_blockers(state, "torch", 1) == [
            "'model' holds sharded parameters (DTensor): they reshard with backend='dcp' only"]
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------- the manager's restore


def as_rank(monkeypatch, rank: int, world: int) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))


def train(state: dict, steps: int, rank: int, world: int) -> None:
    """A few deterministic steps; every rank's model stays the same (replicated), its sampler advances."""
    for _ in range(steps):
        loss = state["model"](torch.ones(2, 4)).sum()
        state["optim"].zero_grad()
        loss.backward()
        state["optim"].step()
        state["sched"].step()
        state["sampler"].advance(2)
        state["tokens"] += 2 * world


def save_world(tmp_path, monkeypatch, world: int, step: int, **manager) -> dict:
    """Every rank of a ``world``-rank job saves ``step`` (the torch backend's saves are per rank); returns rank 0's
    state."""
    states = []
    for rank in range(world):
        as_rank(monkeypatch, rank, world)
        state = job_state(world, rank)
        train(state, step, rank, world)
        random.seed(100 + rank)
        CheckpointManager(tmp_path, **manager).save(step, state)
        states.append(state)
    return states[0]


def test_a_step_restores_into_fewer_ranks_from_rank_0s_part(tmp_path, monkeypatch):
    saved = save_world(tmp_path, monkeypatch, 3, 2)
    step_dir = tmp_path / step_dir_name(2)
    assert verify_step_dir(step_dir).valid
    assert all(read_manifest(step_dir / manifest_name(r)).extra[RESIZABLE] is True for r in range(3))
    draws = {}
    for rank in range(2):
        as_rank(monkeypatch, rank, 2)
        state = job_state(2, rank)
        ckpt = CheckpointManager(tmp_path)
        assert ckpt.restore(state) == 2
        assert ckpt.world_change == WorldChange(2, 3, 2)
        assert str(ckpt.world_change) == "step 2: saved by 3 ranks, restored into 2"
        for a, b in zip(state["model"].parameters(), saved["model"].parameters()):
            assert torch.equal(a, b)
        assert state["optim"].state_dict()["state"][0]["exp_avg"].equal(saved["optim"].state_dict()["state"][0]["exp_avg"])
        assert state["sched"].last_epoch == 2 and state["tokens"] == 12
        assert (state["sampler"].start, state["sampler"].position) == (12, 0)  # 3 ranks x 2 steps x 2 samples
        draws[rank] = (random.random(), float(np.random.random()), torch.rand(1).item())
    assert draws[0] != draws[1]  # re-seeded per rank, not rank 0's streams everywhere
    as_rank(monkeypatch, 1, 2)
    CheckpointManager(tmp_path).restore(job_state(2, 1))
    assert (random.random(), float(np.random.random()), torch.rand(1).item()) == draws[1]  # by rule: the same again


def test_the_rng_rule():
    a = {"torch_cpu": torch.Generator().manual_seed(1).get_state()}
    b = {"torch_cpu": torch.Generator().manual_seed(2).get_state()}
    seeds = {world_change_seed(rng, step, rank) for rng in (a, b) for step in (5, 6) for rank in (0, 1)}
    assert len(seeds) == 8 and all(0 <= s < 2**64 for s in seeds)
    assert world_change_seed(a, 5, 1) == world_change_seed(dict(a), 5, 1)


def test_a_step_restores_into_more_ranks_and_is_never_rewritten_by_them(tmp_path, monkeypatch):
    save_world(tmp_path, monkeypatch, 2, 3)
    step_dir = tmp_path / step_dir_name(3)
    before = sorted(p.name for p in step_dir.iterdir())
    as_rank(monkeypatch, 2, 3)  # a rank the saving world did not have
    state = job_state(3, 2)
    ckpt = CheckpointManager(tmp_path)
    assert ckpt.restore(state) == 3 and ckpt.world_change == WorldChange(3, 2, 3)
    assert (state["sampler"].start, state["sampler"].remaining()) == (12, 4)
    ckpt.save(3, state)  # the same step again right after the restore: the complete 2-rank step stays as it is
    assert sorted(p.name for p in step_dir.iterdir()) == before and verify_step_dir(step_dir).valid


def test_an_unmarked_step_is_refused_in_another_world_naming_the_step_and_both_sizes(tmp_path, monkeypatch):
    save_world(tmp_path, monkeypatch, 3, 2, resizable=False)
    assert RESIZABLE not in read_manifest(tmp_path / step_dir_name(2) / manifest_name(0)).extra
    as_rank(monkeypatch, 0, 2)
    with pytest.raises(WorldChangeError, match=r"step 2 \(.*step_000000002\) was saved by 3 ranks and cannot be "
                                               r"restored into 2: its save was not marked resizable"):
        CheckpointManager(tmp_path).restore(job_state(2, 0))
    ckpt = CheckpointManager(tmp_path, resizable=True)  # the trainer vouches: its state is replicated
    assert ckpt.restore(job_state(2, 0)) == 2 and ckpt.world_change == WorldChange(2, 3, 2)
    # The same world needs no mark.
    as_rank(monkeypatch, 1, 3)
    ckpt = CheckpointManager(tmp_path)
    assert ckpt.restore(job_state(3, 1)) == 2 and ckpt.world_change is None


def test_a_blocked_state_is_not_marked(tmp_path, monkeypatch, caplog):
    as_rank(monkeypatch, 0, 1)
    state = {**job_state(), "mine": OwnState()}
    with caplog.at_level("INFO", logger="trainer_hooks.checkpoint"):
        step_dir = CheckpointManager(tmp_path).save(1, state)
    assert RESIZABLE not in read_manifest(step_dir / manifest_name(0)).extra
    assert "not marked resizable" in caplog.text and "'mine' (OwnState)" in caplog.text


def test_a_step_rlsup_names_from_another_world(tmp_path, monkeypatch, caplog):
    """rlsup's named step is checked where this rank reads it: rank 0's part after a world change."""
    save_world(tmp_path, monkeypatch, 3, 2)
    save_world(tmp_path, monkeypatch, 3, 4, resizable=False)
    monkeypatch.setenv(job_env.CHECKPOINT_DIR, str(tmp_path))
    monkeypatch.setenv(job_env.RESUME_DIR, str(tmp_path / step_dir_name(2)))
    monkeypatch.setenv(job_env.PREVIOUS_WORLD_SIZE, "3")
    as_rank(monkeypatch, 1, 2)
    ckpt = CheckpointManager(tmp_path)
    with caplog.at_level("WARNING", logger="trainer_hooks.checkpoint"):
        assert ckpt.restore(job_state(2, 1)) == 2
    assert ckpt.world_change == WorldChange(2, 3, 2) and "rlsup says" not in caplog.text
    monkeypatch.setenv(job_env.PREVIOUS_WORLD_SIZE, "4")
    with caplog.at_level("WARNING", logger="trainer_hooks.checkpoint"):
        ckpt.restore(job_state(2, 1))
    assert "rlsup says the resumed step was saved by 4 ranks, its manifest says 3" in caplog.text
    monkeypatch.setenv(job_env.RESUME_DIR, str(tmp_path / step_dir_name(4)))
    with pytest.raises(ResumeError, match=r"rank 1 cannot load the step rlsup named .*step 4 .* saved by 3 ranks and "
                                          r"cannot be restored into 2"):
        ckpt.restore(job_state(2, 1))
    monkeypatch.setenv(job_env.RESUME_DIR, str(tmp_path / step_dir_name(2)))
    (tmp_path / step_dir_name(2) / "rank_00000.pt").write_bytes(b"torn")
    with pytest.raises(ResumeError, match=r"rank 1 cannot load .*rank_00000.pt"):
        ckpt.restore(job_state(2, 1))  # rank 1's own part is fine, but it reads rank 0's
