"""megatron-core ``dist_checkpointing`` backend (torch_dist format) in ``step_dir/megatron/``.

Optional: needs ``pip install rlsup[megatron]`` (megatron-core), imported only when this backend is
used. What goes where:

* objects with ``sharded_state_dict()`` (Megatron modules) are saved through it, so Megatron's own
  resharding rules apply; they are restored with ``load_state_dict`` on what Megatron loads;
* tensors in other entries' state_dicts become ``ShardedTensor.from_rank_offsets(key, t,
  replica_id=rank)``: replicated across ranks, written once by rank 0, loaded by every rank;
* ``torch.optim.Optimizer`` entries (their state is keyed by parameter index and created lazily, so
  it has no stable sharded form here), non-tensor values and the RNG go to ``rank_<R>.extra.pt``.

Saving is synchronous on purpose: Megatron's async path starts a ``spawn`` process that re-imports
``__main__`` and hangs scripts without an ``if __name__ == "__main__"`` guard. Its synchronous writer
still asks for a spawn-context ``Manager().Queue()`` only to hand results back to the same process;
:func:`_megatron_save_shims` scopes an in-process queue (and, on CPU-only torch, no-op
``torch.cuda.synchronize`` / CPU ``current_device``) around the call and restores the originals.
Megatron needs a process group; without one a temporary single-rank gloo group is used.
"""

from __future__ import annotations

import contextlib
import queue
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
    split_tensors,
    state_of,
    temporary_process_group,
    tensor_refs,
)
from trainer_hooks.backends.dcp_backend import load_extra

MEGATRON_DIR = "megatron"
_TENSORS = "__rlsup_tensors__"


def _import_megatron() -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
            from megatron.core import dist_checkpointing
    except ImportError as e:
        raise ImportError("the 'megatron' checkpoint backend needs megatron-core: "
                          "pip install rlsup[megatron]") from e
    return dist_checkpointing


@contextlib.contextmanager
def _megatron_save_shims() -> Iterator[None]:
    """Scoped patches for a synchronous megatron save (see module docstring); originals restored."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    saved_queue = filesystem_async._results_queue
    saved_sync, saved_device = torch.cuda.synchronize, torch.cuda.current_device
    if saved_queue is None:
        filesystem_async._results_queue = queue.Queue()
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None
        torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        filesystem_async._results_queue = saved_queue
        torch.cuda.synchronize, torch.cuda.current_device = saved_sync, saved_device


def _is_sharded(obj: Any) -> bool:
    return callable(getattr(obj, "sharded_state_dict", None))


def _keep_whole(live: dict[str, Any]) -> Any:
    return lambda name: isinstance(live.get(name), torch.optim.Optimizer)


class MegatronBackend:
    name = "megatron"
    collective = True

    def __init__(self) -> None:
        self._dc = _import_megatron()  # fail at construction, with the install hint

    def _sharded(self, key: str, t: torch.Tensor, rank: int) -> Any:
        from megatron.core.dist_checkpointing import ShardedTensor

        return ShardedTensor.from_rank_offsets(key, t, replica_id=rank)

    def save(self, ctx: SaveContext, payload: dict[str, Any]) -> None:
        sharded_names = {n for n, obj in ctx.live.items() if _is_sharded(obj)}
        rest = {k: v for k, v in payload.items() if k != RNG_KEY and k not in sharded_names}
        skeleton, tensors = split_tensors(rest, keep=_keep_whole(ctx.live))
        with ctx.new_file(extra_name(ctx.rank)) as f:  # hashed as torch writes it
            torch.save({"skeleton": skeleton, "sharded": sorted(sharded_names), RNG_KEY: payload.get(RNG_KEY)}, f)
        sd: dict[str, Any] = {n: ctx.live[n].sharded_state_dict() for n in sorted(sharded_names)}
        sd[_TENSORS] = {k: self._sharded(k, t.detach(), ctx.rank) for k, t in tensors.items()}
        out = ctx.staging / MEGATRON_DIR
        out.mkdir()
        with temporary_process_group(), _megatron_save_shims():
            self._dc.save(sd, str(out), async_sharded_save=False)

    def load(self, ctx: LoadContext) -> dict[str, Any]:
        extra = load_extra(ctx)
        skeleton, sharded_names = extra["skeleton"], extra["sharded"]
        sd: dict[str, Any] = {}
        for name in sharded_names:
            if name not in ctx.live or not _is_sharded(ctx.live[name]):
                raise ValueError(f"checkpoint entry {name!r} was saved with sharded_state_dict(); "
                                 "pass the same kind of object to restore it")
            sd[name] = ctx.live[name].sharded_state_dict()
        live_state = {n: state_of(o) for n, o in ctx.live.items() if n not in sharded_names}
        _, live = split_tensors(live_state)
        templates = {}
        for ref in tensor_refs(skeleton):
            key = ref["__rlsup_tensor__"]
            current = live.get(key)
            ok = (current is not None and list(current.shape) == ref["shape"]
                  and str(current.dtype).removeprefix("torch.") == ref["dtype"])
            templates[key] = self._sharded(key, current.detach() if ok else empty_like_ref(ref), ctx.rank)
        sd[_TENSORS] = templates
        with temporary_process_group():
            loaded = self._dc.load(sd, str(ctx.step_dir / MEGATRON_DIR))
        payload = fill_tensors(skeleton, loaded.get(_TENSORS, {}))
        for name in sharded_names:
            payload[name] = loaded[name]
        payload[RNG_KEY] = extra.get(RNG_KEY)
        return payload
