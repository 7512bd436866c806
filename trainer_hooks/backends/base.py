"""The backend contract, plus the helpers every backend shares (safe loading, tensor/skeleton split)."""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch

from rlsup_format.digest import FileEntry, HashingWriter

RNG_KEY = "__rng__"
_TENSOR_MARK = "__rlsup_tensor__"


@dataclass
class SaveContext:
    """Where and as whom a rank saves. Files go under ``staging`` with their final relative paths.

    A backend whose serializer takes a file object writes through :meth:`new_file`: the bytes are
    hashed as they pass and the file is fsynced once, so publishing it reads nothing back. Files a
    library writes by path itself are hashed after the fact."""

    step: int
    step_dir: Path
    staging: Path
    rank: int
    world_size: int
    distributed: bool  # a torch.distributed process group is initialised
    live: dict[str, Any] = field(default_factory=dict)  # the caller's objects (sharded_state_dict)
    written: dict[str, FileEntry] = field(default_factory=dict)  # rel -> entry, for files hashed as written

    @contextlib.contextmanager
    def new_file(self, rel: str) -> Iterator[HashingWriter]:
        """A new file ``rel`` (relative, '/'-separated) under ``staging``, hashed while written and
        fsynced when the block ends; its entry lands in :attr:`written`."""
        path = self.staging / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with HashingWriter(path) as writer:
            yield writer
        assert writer.entry is not None
        self.written[rel] = writer.entry


@dataclass
class LoadContext:
    """What a rank loads from. ``live`` gives the current objects, used as templates where needed."""

    step_dir: Path
    rank: int
    world_size: int
    saved_world_size: int
    distributed: bool
    safe_globals: tuple = ()
    live: dict[str, Any] = field(default_factory=dict)

    @property
    def world_changed(self) -> bool:
        return self.saved_world_size != self.world_size

    @property
    def part_rank(self) -> int:
        """Whose per-rank files this rank reads: its own, or rank 0's after a world change (the manager
        lets that happen only for a step marked resizable: :mod:`trainer_hooks.world`)."""
        return 0 if self.world_changed else self.rank


class Backend(Protocol):
    name: str
    #: True when save/load are collectives: every rank must take part, so the manager makes the
    #: "skip, my part is already valid" decision jointly.
    collective: bool

    def save(self, ctx: SaveContext, payload: dict[str, Any]) -> None:
        """Write ``payload`` (name -> state_dict or plain value, plus ``__rng__``) under ctx.staging."""

    def load(self, ctx: LoadContext) -> dict[str, Any]:
        """Read back the payload this rank saved (same shape as given to :meth:`save`)."""


def safe_load(path: Path, safe_globals: tuple = ()) -> Any:
    """``torch.load(weights_only=True)``; extra classes only through the caller's allow-list."""
    with torch.serialization.safe_globals(list(safe_globals)):
        return torch.load(path, map_location="cpu", weights_only=True)


def state_of(obj: Any) -> Any:
    """What gets saved for one entry: its state_dict() when it has one, else the value itself."""
    return obj.state_dict() if callable(getattr(obj, "state_dict", None)) else obj


def split_tensors(payload: dict[str, Any], keep: Callable[[str], bool] = lambda name: False
                  ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Replace every tensor by a small marker dict; return (skeleton, {flat key: tensor}).

    The skeleton holds only plain values, so it loads under ``weights_only=True``; the tensors go to a
    tensor store (DCP, megatron) under keys like ``model/layer.weight`` or ``optim/state/0/exp_avg``.
    Entries for which ``keep(name)`` is true stay whole in the skeleton.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, key: str) -> Any:
        if isinstance(value, torch.Tensor):
            if key in tensors:
                raise ValueError(f"two tensors flatten to the same key {key!r}")
            tensors[key] = value
            return {_TENSOR_MARK: key, "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
        if isinstance(value, dict):
            return _same_dict(value, ((k, walk(v, f"{key}/{k}")) for k, v in value.items()))
        if isinstance(value, list):
            return [walk(v, f"{key}/{i}") for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(walk(v, f"{key}/{i}") for i, v in enumerate(value))
        return value

    skeleton = {name: (value if keep(name) else walk(value, str(name))) for name, value in payload.items()}
    return skeleton, tensors


def _same_dict(original: dict, items: Any) -> dict:
    """OrderedDict stays OrderedDict (module state_dicts); every other mapping becomes a dict."""
    return collections.OrderedDict(items) if isinstance(original, collections.OrderedDict) else dict(items)


def tensor_refs(skeleton: Any) -> Iterator[dict]:
    """Every tensor marker in a skeleton."""
    if isinstance(skeleton, dict):
        if _TENSOR_MARK in skeleton:
            yield skeleton
            return
        for v in skeleton.values():
            yield from tensor_refs(v)
    elif isinstance(skeleton, (list, tuple)):
        for v in skeleton:
            yield from tensor_refs(v)


def empty_like_ref(ref: dict) -> torch.Tensor:
    return torch.empty(ref["shape"], dtype=getattr(torch, ref["dtype"]))


def fill_tensors(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_tensors`: put the loaded tensors back where the markers are."""
    if isinstance(skeleton, dict):
        if _TENSOR_MARK in skeleton:
            return tensors[skeleton[_TENSOR_MARK]]
        return _same_dict(skeleton, ((k, fill_tensors(v, tensors)) for k, v in skeleton.items()))
    if isinstance(skeleton, list):
        return [fill_tensors(v, tensors) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(fill_tensors(v, tensors) for v in skeleton)
    return skeleton


def live_tensors(live: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Flat {key: tensor} of the live objects' current state, to load into in place when shapes match."""
    try:
        _, tensors = split_tensors({name: state_of(obj) for name, obj in live.items()})
    except Exception:  # noqa: BLE001 - templates are an optimisation; markers are the fallback
        return {}
    return tensors


def extra_name(rank: int) -> str:
    return f"rank_{rank:05d}.extra.pt"


@contextlib.contextmanager
def temporary_process_group() -> Iterator[bool]:
    """A one-rank gloo group for libraries that insist on one; yields whether it created it."""
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized():
        yield False
        return
    with tempfile.TemporaryDirectory(prefix="rlsup-pg-") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield True
        finally:
            dist.destroy_process_group()
