"""``torch.distributed.checkpoint`` backend: tensors in ``dcp/`` (reshardable), the rest per rank.

Layout inside the step directory::

    dcp/.metadata            DCP's global index (written by rank 0)
    dcp/__<R>_<i>.distcp     tensor data written by rank R
    rank_<R>.extra.pt        rank R's non-tensor state and RNG (weights_only loadable)

Why the split: DCP pickles non-tensor values and unpickles them with ``weights_only=False``; keeping
only tensors in DCP and everything else in a ``weights_only=True`` file keeps loading safe. (DCP's
own ``.metadata`` index is still a pickle written by torch; the manifest checksum guarantees it is
the file the saver wrote.)

Semantics follow DCP: DTensors/ShardedTensors are saved by their owners and resharded on load;
plain tensors are treated as *replicated* across ranks (saved once, every rank loads that copy), so
per-rank tensors that differ between ranks belong in the ``torch`` backend. Restored into another world
size, DTensors reshard, replicated tensors load everywhere, and every rank reads rank 0's extra file. Save and load are
collectives when a process group is initialised (every rank must call them), and the checkpoint
directory must be visible to all ranks (a shared filesystem) for loading. Without a process group
it runs single-process.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch

from trainer_hooks.backends.base import (
    RNG_KEY,
    LoadContext,
    SaveContext,
    empty_like_ref,
    extra_name,
    fill_tensors,
    live_tensors,
    safe_load,
    split_tensors,
    tensor_refs,
)

DCP_DIR = "dcp"


def _matches(live: torch.Tensor | None, ref: dict) -> bool:
    return (live is not None and list(live.shape) == ref["shape"]
            and str(live.dtype).removeprefix("torch.") == ref["dtype"])


def load_extra(ctx: LoadContext) -> dict[str, Any]:
    """This rank's extra file; after a world-size change every rank reads rank 0's (:attr:`LoadContext.part_rank`)."""
    return safe_load(ctx.step_dir / extra_name(ctx.part_rank), ctx.safe_globals)


def _has_saved_state(entry: Any) -> bool:
    return isinstance(entry, dict) and bool(entry.get("state"))


def create_optimizer_state(optim: torch.optim.Optimizer) -> None:
    """Give an optimizer that never stepped its state tensors, so DCP loads into them in place.

    Why: an optimizer creates its state on the first step, shaped and placed like each parameter. Over
    sharded parameters (FSDP2's DTensors) a template built from the saved shape alone would be a plain
    full tensor, and the next step would mix it with DTensor gradients. As torch's own
    ``torch.distributed.checkpoint.state_dict.set_state_dict`` does: one step with zero gradients and a
    learning rate of 0, then the gradients are dropped; what the step wrote is overwritten by the load."""
    params = [p for group in optim.param_groups for p in group["params"]]
    if optim.state or any(p.grad is not None for p in params):
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optim.param_groups]
    for group in optim.param_groups:
        group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optim.step()
    finally:
        for group, lr in zip(optim.param_groups, lrs):
            group["lr"] = lr
        optim.zero_grad(set_to_none=True)


def _prepare_optimizers(live: dict[str, Any], skeleton: dict[str, Any]) -> None:
    """Create the state of each live optimizer over sharded parameters whose saved entry has state."""
    for name, obj in live.items():
        if isinstance(obj, torch.optim.Optimizer) and _has_saved_state(skeleton.get(name)) and _sharded(obj):
            create_optimizer_state(obj)


def _sharded(optim: torch.optim.Optimizer) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(p, DTensor) for group in optim.param_groups for p in group["params"])


@contextlib.contextmanager
def _quiet_single_process(distributed: bool) -> Iterator[None]:
    """Single-process use is intended here; DCP's "assuming single process" warning is noise."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class DcpBackend:
    name = "dcp"
    collective = True

    def save(self, ctx: SaveContext, payload: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        rest = {k: v for k, v in payload.items() if k != RNG_KEY}
        skeleton, tensors = split_tensors(rest)
        with ctx.new_file(extra_name(ctx.rank)) as f:  # hashed as torch writes it
            torch.save({"skeleton": skeleton, RNG_KEY: payload.get(RNG_KEY)}, f)
        # Each rank points DCP at its own staging dir: a rank only ever writes its own files there
        # (rank 0 adds .metadata), and the manager renames them into step_dir/dcp afterwards.
        # sync_files=False: publishing fsyncs each file once (DCP would sync them a second time).
        writer = dcp.FileSystemWriter(str(ctx.staging / DCP_DIR), sync_files=False)
        with _quiet_single_process(ctx.distributed):
            dcp.save(tensors, storage_writer=writer, no_dist=not ctx.distributed)

    def load(self, ctx: LoadContext) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        extra = load_extra(ctx)
        skeleton = extra["skeleton"]
        _prepare_optimizers(ctx.live, skeleton)
        live = live_tensors(ctx.live)
        template = {}
        for ref in tensor_refs(skeleton):
            key = ref["__rlsup_tensor__"]
            current = live.get(key)
            # Loading into the live tensor keeps its placement (DTensor sharding, device).
            template[key] = current if _matches(current, ref) else empty_like_ref(ref)
        reader = dcp.FileSystemReader(str(ctx.step_dir / DCP_DIR))
        with _quiet_single_process(ctx.distributed):
            dcp.load(template, storage_reader=reader, no_dist=not ctx.distributed)
        payload = fill_tensors(skeleton, template)
        payload[RNG_KEY] = extra.get(RNG_KEY)
        return payload
