"""Make DistributedDataParallel reduce gradients in the same order in every step, resumed or not.

Why: DDP sums gradients bucket by bucket. Its reducer starts with an initial bucket layout, records
the order in which gradients became ready during the first backward pass, and rebuilds its buckets
in that order once, at the start of the next forward (``reducer._rebuild_buckets()`` in
``DistributedDataParallel._pre_forward``). The layout decides where each gradient sits in the
flattened bucket, and with it the order in which gloo (or NCCL) adds up the ranks' values. With two
ranks that order does not matter (``a + b == b + a`` exactly); with three or more it does, because
floating-point addition is not associative. So an uninterrupted run takes its first step with the
initial layout and every later step with the rebuilt one, while a run resumed at step N takes step
N+1 with the initial layout: its weights differ from the uninterrupted run's by a few ulps from the
first resumed step on, although the checkpoint, the RNG streams and the data order are identical.

:func:`prime_ddp`, called once right after ``CheckpointManager.restore`` (on a fresh start too),
runs a throwaway forward and backward pass through the DDP module and rebuilds the buckets, then
puts back everything the pass touched. Every real step of every run, interrupted or not, then uses
the final layout, so a resumed run matches an uninterrupted one bit for bit.

When the layout never changes (read from torch's ``Reducer::should_rebuild_buckets``, which is
``(static_graph || !find_unused_parameters) && !has_rebuilt_bucket``):

- ``find_unused_parameters=True`` (without ``static_graph``): DDP never rebuilds its buckets; the
  construction-time layout is used in every step, so a resume is already exact in this respect and
  :func:`prime_ddp` returns False without running anything.
- ``static_graph=True``: the first backward pass defers all reductions to its end and records no
  grad-ready order; the order is recorded in the second pass and the buckets are rebuilt after it.
  :func:`prime_ddp` therefore runs as many passes as it takes (two) before the rebuild succeeds.

Limits: the rebuilt layout is the grad-ready order of the priming pass on rank 0 (broadcast to the
others), so it is decided by the example input, the same in every run: data-dependent control flow
cannot make two runs disagree, but the example must reach the same parameters as a real batch
(``find_unused_parameters=False`` raises otherwise; ``static_graph=True`` keeps the priming pass's
graph and raises when a real step differs). Not rolled back, because they run inside backward: a
DDP communication hook with state (PowerSGD counts iterations and keeps error feedback), an
optimizer stepped from ``register_post_accumulate_grad_hook``, a module hook with side effects. The
passes are collectives: every rank calls :func:`prime_ddp`, with input of the same shape.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch

from trainer_hooks.rng import capture_rng_state, restore_rng_state

log = logging.getLogger(__name__)

#: static_graph needs two passes (see the module docstring); one more is room for torch changing.
MAX_PASSES = 3


def _tensors(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor inside ``value`` (tensors, lists, tuples, dicts, namedtuples, dataclasses)."""
    if depth > 32:
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, f.name) for f in dataclasses.fields(value)]
    else:
        return []
    return [t for item in items for t in _tensors(item, depth + 1)]


def _zero_loss(output: Any) -> torch.Tensor:
    parts = [t if not t.is_complex() else torch.view_as_real(t) for t in _tensors(output)
             if t.requires_grad and (t.is_floating_point() or t.is_complex())]
    if not parts:
        raise ValueError("prime_ddp: the model's output holds no tensor that requires grad; pass loss_fn=")
    return torch.stack([t.sum() for t in parts]).sum() * 0


def prime_ddp(model: torch.nn.Module, *example_args: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None,
              **example_kwargs: Any) -> bool:
    """Rebuild DDP's gradient buckets now, so every real step reduces in the final order.

    Call it once on every rank, right after ``ckpt.restore(state)`` and before the first training
    step, with example input of a real batch's shape (built without drawing random numbers, e.g.
    ``torch.zeros(batch_size, features)``): ``prime_ddp(model, example_batch)``. It runs forward and
    backward through ``model`` with a zero loss (the sum of every tensor in the output times 0, or
    ``loss_fn(output)``; its gradients are discarded either way) until the reducer has rebuilt its
    buckets, then restores the RNG streams (Python, NumPy, torch CPU and CUDA), every buffer
    (BatchNorm running statistics, ...) and every parameter's ``.grad`` (normally None) to what they
    were. No optimizer is stepped.

    Returns True when the buckets were rebuilt; False, doing nothing, when ``model`` is not a
    DistributedDataParallel, its buckets were already rebuilt, or its layout never changes
    (``find_unused_parameters=True`` without ``static_graph``; see the module docstring).
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return False
    reducer = getattr(model, "reducer", None)
    if (reducer is None or getattr(model, "_has_rebuilt_buckets", False)
            or getattr(model, "_use_python_reducer", False) or getattr(model, "_delay_all_reduce_all_params", False)):
        return False
    if model.find_unused_parameters and not model.static_graph:
        return False  # the reducer never rebuilds: its construction-time layout is already final
    if not model.require_backward_grad_sync:
        raise RuntimeError("prime_ddp: called inside model.no_sync(); DDP does not reduce there")

    rng = capture_rng_state()
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    rebuilt = False
    try:
        for p in params:
            p.grad = None  # the pass must not accumulate into (and DDP must not overwrite) existing grads
        with torch.enable_grad():
            for _ in range(MAX_PASSES):
                output = model(*example_args, **example_kwargs)
                loss = loss_fn(output) if loss_fn is not None else _zero_loss(output)
                loss.backward()
                del output, loss
                if reducer._rebuild_buckets():  # a collective: rank 0's order is broadcast
                    rebuilt = True
                    model._has_rebuilt_buckets = True  # what _pre_forward records after its own rebuild
                    break
    finally:
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.grad = g
            for b, saved in buffers:
                if b.shape == saved.shape:
                    b.copy_(saved)
                else:
                    b.set_(saved)
        restore_rng_state(rng)
    if not rebuilt:
        log.warning("prime_ddp: DDP did not rebuild its buckets after %d passes; steps may reduce in "
                    "another order after a resume", MAX_PASSES)
    return rebuilt
