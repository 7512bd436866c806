"""A DistributedSampler that remembers how far into the epoch it got, so a resume skips nothing and repeats nothing.

Same order as ``torch.utils.data.DistributedSampler`` (permutation from ``seed + epoch``, padding by
wrapping or ``drop_last`` truncation, rank ``r`` takes every ``num_replicas``-th index from ``r``),
plus ``state_dict()`` = ``{"epoch", "seed", "position"}`` where ``position`` is the number of
indices of this epoch already handed out. After ``load_state_dict()`` the next iteration yields
exactly the remaining indices of that epoch.

Counting, and which data loaders are exact:

* ``DataLoader(..., num_workers=0)``: exact with no extra calls. The loader pulls indices only when it
  builds the next batch, so after ``k`` batches exactly ``k * batch_size`` indices were handed out.
* ``torchdata.stateful_dataloader.StatefulDataLoader`` (any ``num_workers``): exact. Save the
  *loader* (``state["loader"] = loader``), not the sampler as well: the loader snapshots this
  sampler's ``state_dict()`` when each batch's indices are drawn and restores the snapshot that
  matches the batches actually delivered, prefetching included.
* ``DataLoader(..., num_workers>0)`` (plain): workers prefetch, so handed-out indices run ahead of
  the batches the loop consumed. Build the sampler with ``count="manual"`` and call
  ``sampler.advance(len(batch))`` after each consumed batch; ``position`` is then what the loop
  really used.

Give every DataLoader its own ``generator=torch.Generator()``: a DataLoader draws a base seed from
its generator (default: the *global* torch RNG) each time an iterator is created, and a resumed run
creates iterators at other moments than the uninterrupted one, which would shift the global stream.

Epochs: drive the epoch loop from the sampler so a restore is not undone::

    step = ckpt.restore(state)
    for epoch in range(sampler.epoch, num_epochs):
        sampler.set_epoch(epoch)        # same epoch: keeps a restored mid-epoch position
        for batch in loader: ...

Epoch-boundary trap: a state saved after the last batch of an epoch has ``position == len(self)``.
Restoring it moves to ``epoch + 1``, position 0 (never an exhausted iterator that yields nothing).

Another world size (a job shrunk or grown between save and restore): the data position is global.
Every epoch is one list, the permutation ``P`` of the dataset; the ranks of a world of ``W`` take it
round-robin, so after each rank consumed ``p`` indices the world together consumed the prefix
``P[:start + p * W]`` (``start`` is 0 unless the epoch was already resumed in another world). The
state records that global position and ``W``. Loaded into a world of ``W'`` ranks, the sampler
resumes the same epoch at the same global position: the remaining ``P[g:]`` is dealt round-robin
over the ``W'`` ranks, so across the whole run every sample of the epoch is consumed exactly once.
This assumes what synchronous data parallelism guarantees: every rank consumed the same number of
indices when the state was saved (each rank's state then names the same global position).

The epoch's tail follows DistributedSampler's rules, applied to the part dealt in the new world:
``drop_last=False`` pads the last round with the first samples of the epoch's permutation until every
rank has the same count (those few samples are seen twice in that epoch, as with DistributedSampler);
``drop_last=True`` drops the fewer than ``W'`` samples that would not fill a last round. A state saved
after the epoch's last round resumes at the next epoch, in any world. ``len(sampler)`` stays the
per-rank count of a whole epoch in the current world; after a world change mid-epoch the iterator
yields this rank's share of the rest (:meth:`remaining`). The state dict of a sampler never moved across
worlds loads as before, and states from before this rule (without ``world_size``) load into the same
world only.
"""

from __future__ import annotations

import math
import os
import typing
from typing import Any, Iterator, Literal

import torch
from torch.utils.data import Sampler

#: How the position advances: by the indices the sampler hands out, or by the loop's own advance() calls.
SamplerCount = Literal["yield", "manual"]
COUNTS: tuple[SamplerCount, ...] = typing.get_args(SamplerCount)


def _default_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def _share(remaining: int, world: int, drop_last: bool) -> int:
    """Indices per rank when ``remaining`` indices of an epoch are dealt over ``world`` ranks
    (DistributedSampler's count: padded up to a full round, or cut down to one with ``drop_last``)."""
    return remaining // world if drop_last else math.ceil(remaining / world)


class ResumableSampler(Sampler[int]):
    """DistributedSampler semantics plus an exact, checkpointable position within the epoch."""

    def __init__(self, dataset_len: int, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, *,
                 count: SamplerCount = "yield") -> None:
        if num_replicas is None or rank is None:
            world, this_rank = _default_world()
            num_replicas = world if num_replicas is None else num_replicas
            rank = this_rank if rank is None else rank
        if dataset_len < 0:
            raise ValueError(f"dataset_len must be >= 0, got {dataset_len}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"invalid rank {rank} for num_replicas {num_replicas}")
        if count not in COUNTS:
            raise ValueError(f"count must be one of {', '.join(map(repr, COUNTS))} (indices handed out, or "
                             f"advance()), got {count!r}")
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.count = count
        self.epoch = 0
        self.start = 0  # where in the epoch's permutation this world's share began (> 0: resumed from another world)
        self.position = 0
        self._iter_token = 0
        self.num_samples = _share(dataset_len, num_replicas, drop_last)  # DistributedSampler's, for a whole epoch
        self.total_size = self.num_samples * num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def remaining(self) -> int:
        """This rank's indices of the current epoch from ``start`` on (``len(self)`` when ``start`` is 0)."""
        return _share(self.dataset_len - self.start, self.num_replicas, self.drop_last)

    def _permutation(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(self.dataset_len, generator=g).tolist()
        return list(range(self.dataset_len))

    def epoch_indices(self) -> list[int]:
        """This rank's index list for the current epoch from ``start`` on (DistributedSampler's exact
        order when ``start`` is 0; see the module docstring for the rest of an epoch in another world)."""
        perm = self._permutation()
        indices = perm[self.start:]
        total = self.remaining() * self.num_replicas
        padding = total - len(indices)
        if padding > 0 and perm:  # from the epoch's first samples, as DistributedSampler pads
            indices += perm[:padding] if padding <= len(perm) else (perm * math.ceil(padding / len(perm)))[:padding]
        return indices[self.rank: total: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        if self.position >= self.remaining():
            # A finished pass without set_epoch: replay the epoch, like DistributedSampler (all of it, in this world).
            self.start, self.position = 0, 0
        self._iter_token += 1
        return self._generate(self._iter_token, self.position)

    def _generate(self, token: int, start: int) -> Iterator[int]:
        indices = self.epoch_indices()
        for i in range(start, len(indices)):
            # Count *before* handing the index out: a state_dict() taken while the consumer holds
            # it includes it. Only the newest iterator counts (DataLoader may drop an old one).
            if self.count == "yield" and token == self._iter_token:
                self.position = i + 1
            yield indices[i]

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch's permutation; the same epoch again keeps the (restored) position."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.start, self.position = 0, 0

    def advance(self, n: int) -> None:
        """``count="manual"``: record that the loop consumed ``n`` more samples of this epoch."""
        if self.count != "manual":
            raise RuntimeError("advance() is for count='manual' samplers; 'yield' counts by itself")
        if n < 0:
            raise ValueError("n must be >= 0")
        self.position = min(self.position + n, self.remaining())

    @property
    def consumed(self) -> int:
        """Samples of the current epoch this rank used since ``start`` (handed out, or advanced in manual mode)."""
        return self.position

    @property
    def global_position(self) -> int:
        """Indices of the epoch's permutation the whole world consumed (every rank at this rank's position)."""
        return self.start + self.position * self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "seed": self.seed, "position": self.position, "num_samples": self.num_samples,
                "world_size": self.num_replicas, "dataset_len": self.dataset_len, "start": self.start,
                "global_position": self.global_position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, seed, position = int(state["epoch"]), int(state["seed"]), int(state["position"])
        if position < 0:
            raise ValueError(f"negative sampler position {position}")
        saved_world = state.get("world_size")
        same_world = saved_world is None or int(saved_world) == self.num_replicas  # None: saved before world sizes
        saved_len = state.get("num_samples", self.num_samples)
        if same_world and saved_len != self.num_samples:
            raise ValueError(f"sampler state is for {saved_len} samples per rank, this sampler has "
                             f"{self.num_samples} (dataset size or world size changed)")
        saved_dataset = state.get("dataset_len", self.dataset_len)
        if saved_dataset != self.dataset_len:
            raise ValueError(f"sampler state is for a dataset of {saved_dataset} samples, this sampler has "
                             f"{self.dataset_len} (dataset size changed)")
        if same_world:
            start = int(state.get("start", 0))
        else:  # another world: resume the epoch at the same global position (module docstring)
            saved_world, start = int(saved_world), int(state.get("start", 0))
            if position < _share(self.dataset_len - start, saved_world, self.drop_last):
                start, position = start + position * saved_world, 0
            else:  # that world had finished the epoch
                epoch, start, position = epoch + 1, 0, 0
        if not 0 <= start <= self.dataset_len:
            raise ValueError(f"sampler start {start} outside a dataset of {self.dataset_len}")
        self.seed = seed
        self.epoch, self.start, self.position = epoch, start, position
        if position >= self.remaining():
            self.epoch, self.start, self.position = epoch + 1, 0, 0  # the epoch was finished: resume at the next one
        self._iter_token += 1  # an iterator from before the restore no longer counts
