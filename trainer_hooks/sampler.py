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
        self.position = 0
        self._iter_token = 0
        if drop_last and dataset_len % num_replicas != 0:
            self.num_samples = math.ceil((dataset_len - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(dataset_len / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def epoch_indices(self) -> list[int]:
        """This rank's full index list for the current epoch (DistributedSampler's exact order)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            indices = list(range(self.dataset_len))
        if not self.drop_last:
            padding = self.total_size - len(indices)
            if padding > 0 and indices:
                if padding <= len(indices):
                    indices += indices[:padding]
                else:
                    indices += (indices * math.ceil(padding / len(indices)))[:padding]
        else:
            indices = indices[: self.total_size]
        return indices[self.rank: self.total_size: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        if self.position >= self.num_samples:
            self.position = 0  # a finished pass without set_epoch: replay the epoch, like DistributedSampler
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
            self.position = 0

    def advance(self, n: int) -> None:
        """``count="manual"``: record that the loop consumed ``n`` more samples of this epoch."""
        if self.count != "manual":
            raise RuntimeError("advance() is for count='manual' samplers; 'yield' counts by itself")
        if n < 0:
            raise ValueError("n must be >= 0")
        self.position = min(self.position + n, self.num_samples)

    @property
    def consumed(self) -> int:
        """Samples of the current epoch already used (handed out, or advanced in manual mode)."""
        return self.position

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "seed": self.seed, "position": self.position,
                "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, seed, position = int(state["epoch"]), int(state["seed"]), int(state["position"])
        if position < 0:
            raise ValueError(f"negative sampler position {position}")
        saved_len = state.get("num_samples", self.num_samples)
        if saved_len != self.num_samples:
            raise ValueError(f"sampler state is for {saved_len} samples per rank, this sampler has "
                             f"{self.num_samples} (dataset size or world size changed)")
        self.seed = seed
        if position >= self.num_samples:
            epoch, position = epoch + 1, 0  # the epoch was finished: resume at the next one
        self.epoch = epoch
        self.position = position
        self._iter_token += 1  # an iterator from before the restore no longer counts
