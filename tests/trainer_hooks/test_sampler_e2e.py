"""The end-to-end half of test_sampler.py (real processes, or waits on real time): resumableSampler:
DistributedSampler order, exact mid-epoch resume, and the epoch-boundary trap."""

from __future__ import annotations



from trainer_hooks.sampler import ResumableSampler
from support.datasets import Indices
from test_sampler import run_epochs






def test_stateful_dataloader_with_workers_is_exact():
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make():
        s = ResumableSampler(24, 1, 0, seed=9)
        return s, StatefulDataLoader(Indices(24), batch_size=3, sampler=s, num_workers=2)

    s, dl = make()
    full = run_epochs(dl, s, 2)
    s, dl = make()
    first = run_epochs(dl, s, 2, stop_after=5)   # workers have prefetched beyond batch 5
    assert s.position > 15                        # the sampler handed out more than was consumed...
    saved = dl.state_dict()                       # ...but the loader's snapshot is exact
    s2, dl2 = make()
    dl2.load_state_dict(saved)
    rest = run_epochs(dl2, s2, 2)
    assert first + rest == full


