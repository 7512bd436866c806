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
per-rank tensors that differ between ranks belong in the ``torch`` backend. Save and load are
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
    """This rank's extra file; after a world-size change new ranks borrow rank 0's skeleton."""
    path = ctx.step_dir / extra_name(ctx.rank)
    if not path.exists() and ctx.rank >= ctx.saved_world_size:
        import logging

        logging.getLogger(__name__).warning("rank %d has no saved extra state (saved world size %d); "
                                            "using rank 0's", ctx.rank, ctx.saved_world_size)
        path = ctx.step_dir / extra_name(0)
    return safe_load(path, ctx.safe_globals)


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
