"""ResumableSampler: DistributedSampler order, exact mid-epoch resume, and the epoch-boundary trap."""

from __future__ import annotations

import itertools

import pytest
from support.datasets import Indices
from torch.utils.data import DataLoader, DistributedSampler

from trainer_hooks.sampler import ResumableSampler


@pytest.mark.parametrize("n, world, drop_last, shuffle", [
    (10, 3, False, True), (10, 3, True, True), (2, 5, False, True), (17, 4, False, False), (16, 4, True, True)])
def test_same_order_as_distributed_sampler(n, world, drop_last, shuffle):
    for rank in range(world):
        for epoch in (0, 3):
            ref = DistributedSampler(Indices(n), world, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
            ref.set_epoch(epoch)
            s = ResumableSampler(n, world, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
            s.set_epoch(epoch)
            assert list(s) == list(ref) and len(s) == len(ref)


def run_epochs(loader, sampler, epochs, stop_after=None):
    """The documented training loop; returns the batches seen (and stops early if asked)."""
    seen = []
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            seen.append(batch.tolist())
            if stop_after is not None and len(seen) == stop_after:
                return seen
    return seen


@pytest.mark.parametrize("stop_after", [1, 3, 4, 5, 8])  # 4 batches per epoch: 4 and 8 are boundaries
def test_resume_plain_dataloader_is_exact(stop_after):
    def make():
        s = ResumableSampler(16, 2, 1, seed=3)
        return s, DataLoader(Indices(16), batch_size=2, sampler=s, num_workers=0)

    s, dl = make()
    full = run_epochs(dl, s, 3)
    s, dl = make()
    first = run_epochs(dl, s, 3, stop_after=stop_after)
    saved = s.state_dict()
    s2, dl2 = make()
    s2.load_state_dict(saved)
    rest = run_epochs(dl2, s2, 3)
    assert first + rest == full


def test_epoch_boundary_moves_to_next_epoch():
    s = ResumableSampler(10, 1, 0, seed=1)
    list(s)
    state = s.state_dict()
    assert state["position"] == len(s) and state["epoch"] == 0
    s2 = ResumableSampler(10, 1, 0, seed=1)
    s2.load_state_dict(state)
    assert (s2.epoch, s2.position) == (1, 0)
    nxt = list(s2)
    assert len(nxt) == 10  # not an exhausted iterator
    ref = ResumableSampler(10, 1, 0, seed=1)
    ref.set_epoch(1)
    assert nxt == list(ref)


def test_load_rejects_other_geometry():
    s = ResumableSampler(10, 2, 0)
    with pytest.raises(ValueError, match="samples per rank"):
        ResumableSampler(12, 2, 0).load_state_dict(s.state_dict())


def test_manual_count_with_plain_workers():
    def make():
        s = ResumableSampler(24, 1, 0, seed=2, count="manual")
        return s, DataLoader(Indices(24), batch_size=4, sampler=s, num_workers=2)

    s, dl = make()
    full = run_epochs(dl, s, 1)
    s, dl = make()
    first = []
    for batch in itertools.islice(dl, 3):
        first.append(batch.tolist())
        s.advance(len(batch))
    saved = s.state_dict()
    assert saved["position"] == 12
    s2, dl2 = make()
    s2.load_state_dict(saved)
    rest = []
    for batch in dl2:
        rest.append(batch.tolist())
        s2.advance(len(batch))
    assert first + rest == full
    with pytest.raises(RuntimeError):
        ResumableSampler(4, 1, 0).advance(1)
