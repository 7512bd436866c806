"""A step saved by W ranks restored into W' ranks: the global batch, the mark that says a save may move, the RNG rule.

Why a module of its own: when rlsup runs out of spares it may continue a job on fewer nodes (and grow it
back later) instead of waiting for a replacement. Which saves may cross world sizes is decided here, at
save time, from what the trainer hands to :class:`trainer_hooks.checkpoint.CheckpointManager`, and
written into each rank's manifest (:data:`rlsup_format.manifest.RESIZABLE`), so rlsup knows before it
shrinks a job whether the trainer can follow.

What moves, and how (the rules the manager and the backends apply on a world change):

* model and optimizer: with ``backend="dcp"`` sharded tensors (FSDP2 ``fully_shard``, DTensor) are
  resharded by ``torch.distributed.checkpoint``, plain tensors are taken as replicated; with
  ``backend="torch"`` every new rank loads rank 0's part, so the state must be replicated (DDP, or a
  plain module whose gradients are all-reduced by hand);
* the data position: :class:`trainer_hooks.sampler.ResumableSampler` records the global position in
  the epoch and deals the rest over the new ranks (no sample skipped or repeated);
* plain values and other per-rank state: rank 0's (data-parallel ranks hold the same);
* the RNG: not restored, since there is no saved stream for a rank that did not exist and a rank's old
  stream no longer matches its data. Every rank re-seeds Python, NumPy and torch (CPU and every CUDA
  device) from :func:`world_change_seed`: the saved rank 0 torch CPU generator state, the step and the
  new rank. Deterministic (two runs that change world at the same step draw the same numbers), but a
  run whose world changed is not bit-identical to one that never changed: the RNG streams, the ranks'
  share of each batch and the order in which gradients are summed all differ.

The global batch stays the same across worlds through gradient accumulation: :func:`grad_accum_steps`.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

from rlsup_format import job_env

#: Backends whose restore can map a step onto another world size (megatron keeps optimizers per rank).
RESIZABLE_BACKENDS = ("torch", "dcp")


@dataclass(frozen=True)
class WorldChange:
    """What :meth:`CheckpointManager.restore` tells the trainer when the step came from another world size."""

    step: int
    saved_world_size: int
    world_size: int

    def __str__(self) -> str:
        return f"step {self.step}: saved by {self.saved_world_size} ranks, restored into {self.world_size}"


class WorldChangeError(ValueError):
    """A step cannot be restored into this world size; the message names the step and both sizes."""


def grad_accum_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Gradient-accumulation steps that keep ``global_batch`` samples per optimizer step over
    ``world_size`` ranks of ``micro_batch`` each; a ValueError naming all three when they do not divide."""
    for name, value in (("global batch", global_batch), ("micro batch", micro_batch), ("world size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    per_step = micro_batch * world_size
    if global_batch % per_step:
        fits = [w for w in range(1, world_size + 1) if global_batch % (micro_batch * w) == 0]
        raise ValueError(f"global batch {global_batch} cannot be split over world size {world_size} with micro batch "
                         f"{micro_batch}: {global_batch} is not a multiple of {micro_batch} x {world_size} = "
                         f"{per_step} (world sizes up to {world_size} that fit: {', '.join(map(str, fits)) or 'none'})")
    return global_batch // per_step


def previous_world_size() -> int | None:
    """The world size rlsup says the resumed step was saved by, when the job's size changed (else None)."""
    value = os.environ.get(job_env.PREVIOUS_WORLD_SIZE, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def world_change_seed(saved_rng: dict[str, Any] | None, step: int, rank: int) -> int:
    """The seed rank ``rank`` draws from after a world change at ``step``: the first 8 bytes of SHA-256 over
    the saved rank 0 torch CPU generator state (so two runs with other seeds stay apart), the step and the rank."""
    h = hashlib.sha256(b"rlsup world change\0")
    cpu = (saved_rng or {}).get("torch_cpu")
    if cpu is not None:
        h.update(bytes(cpu.tolist()))
    h.update(f"\0{step}\0{rank}".encode())
    return int.from_bytes(h.digest()[:8], "little")


# ---------------------------------------------------------------------------- the resizable mark


def resize_blockers(state: dict[str, Any], backend: str, world_size: int) -> list[str]:
    """Why a save of ``state`` could not be restored into another world size ([] when it can).

    Taken as moving safely: a :class:`~trainer_hooks.sampler.ResumableSampler` (required: without it
    the data position is unknown), DDP, plain modules (replicated, as data parallelism keeps them),
    FSDP2/DTensor modules with ``backend="dcp"``, optimizers over those, LR schedulers, plain values.
    Anything else with a ``state_dict`` is per-rank state rlsup cannot judge."""
    from trainer_hooks.sampler import ResumableSampler

    if backend not in RESIZABLE_BACKENDS:
        return [f"the {backend!r} backend keeps per-rank state (resizable: {', '.join(RESIZABLE_BACKENDS)})"]
    reasons = [reason for name, obj in state.items() if (reason := _blocker(name, obj, backend, world_size))]
    if not any(isinstance(obj, ResumableSampler) for obj in state.values()):
        reasons.append("no ResumableSampler in the state: the data position could not be carried over")
    return reasons


def _blocker(name: str, obj: Any, backend: str, world_size: int) -> str:
    import torch

    from trainer_hooks.sampler import ResumableSampler

    kind = type(obj).__name__
    if isinstance(obj, ResumableSampler) or not callable(getattr(obj, "state_dict", None)):
        return ""  # the global data position; or a plain value (rank 0's is restored)
    if isinstance(obj, torch.nn.Module):
        if kind == "FullyShardedDataParallel":
            return f"{name!r} is FSDP1 (its optimizer state is per rank): use fully_shard (FSDP2) with backend='dcp'"
        if backend != "dcp" and _has_dtensor(obj):
            return f"{name!r} holds sharded parameters (DTensor): they reshard with backend='dcp' only"
        return ""  # DDP or a plain module: replicated; FSDP2 with dcp: resharded
    if isinstance(obj, torch.optim.Optimizer):
        if kind == "ZeroRedundancyOptimizer":
            return f"{name!r} is a ZeroRedundancyOptimizer: its state is sharded per rank"
        return ""  # its state follows its parameters
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or kind == "ReduceLROnPlateau":
        return ""
    if kind == "StatefulDataLoader":
        return f"{name!r} is a StatefulDataLoader: its position counts this world's batches (save the ResumableSampler)"
    return f"{name!r} ({kind}) keeps state rlsup cannot judge across world sizes"


def _has_dtensor(module: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(p, DTensor) for p in module.parameters())
