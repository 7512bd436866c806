"""torch.distributed.checkpoint (DCP) directories: ``.metadata`` plus ``*.distcp`` shard files.

DCP's ``FileSystemWriter`` writes every shard first and the ``.metadata`` pickle last (through a
temp file and rename), so a DCP without a loadable ``.metadata`` was never finished. With the
metadata, each storage entry names (file, offset, length); a shard shorter than its last entry was
cut short. Both checks read only the metadata pickle and ``stat`` the shards.

The pickle is read with :mod:`supervisor.layouts.inert_pickle`: torch's and Megatron's metadata classes become
inert stubs (torch is never imported), anything else is refused, so a hostile or foreign ``.metadata`` cannot run
code in the supervisor.
"""

from __future__ import annotations

import pathlib
import pickle
import re
from pathlib import Path
from typing import Any

from supervisor.layouts.files import tree_size
from supervisor.layouts.inert_pickle import PLAIN, InertUnpickler
from supervisor.layouts.record import Check, CheckpointRecord

NAME = "dcp"
METADATA = ".metadata"
_STEP_IN_NAME = re.compile(r"(\d+)(?!.*\d)")

# What a DCP .metadata may name: torch's and Megatron's metadata classes and values become stubs (nothing of torch is
# imported: supervisor.layouts.inert_pickle); a few plain containers are built as themselves; anything else is refused
_STUBBED_PREFIXES = ("torch.", "megatron.core.dist_checkpointing")
_REAL = {
    **PLAIN,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("torch", "Size"): tuple,
}


def _stubbed(module: str, name: str) -> bool:
    return module == "torch" or module.startswith(_STUBBED_PREFIXES)


def load_metadata(directory: Path) -> tuple[Any, str | None]:
    """(Metadata, None) or (None, why). Never raises: torn pickles are an expected outcome."""
    path = directory / METADATA
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, f"{METADATA} missing (DCP writes it last: save never finished)"
    except OSError as exc:
        return None, f"{METADATA} unreadable: {exc}"
    if not data:
        return None, f"{METADATA} is empty (torn write)"
    try:
        return InertUnpickler(data, _REAL, _stubbed, refusal=" from a DCP .metadata").load(), None
    except pickle.UnpicklingError as exc:
        if "refusing" in str(exc):
            return None, str(exc)
        return None, f"{METADATA} is torn or corrupt ({exc})"
    except Exception as exc:  # noqa: BLE001 - any error from a torn pickle is a failed check, not a crash
        return None, f"{METADATA} is torn or corrupt ({type(exc).__name__}: {exc})"


def looks_like_dcp(directory: Path) -> bool:
    """A directory that DCP wrote or was writing: a .metadata or at least one .distcp shard."""
    if (directory / METADATA).exists():
        return True
    try:
        return any(p.suffix == ".distcp" for p in directory.iterdir())
    except OSError:
        return False


def storage_extents(metadata: Any) -> dict[str, int] | None:
    """Bytes each shard file must hold at least: max(offset + length) over its storage entries."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return None
    need: dict[str, int] = {}
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        end = int(getattr(info, "offset", 0) or 0) + int(getattr(info, "length", 0) or 0)
        need[str(rel)] = max(need.get(str(rel), 0), end)
    return need


def check_dcp(directory: Path) -> Check:
    """Valid when .metadata loads and every storage entry lies inside an existing, long-enough file."""
    if not directory.is_dir():
        return Check.bad(f"{directory.name}/ missing")
    metadata, err = load_metadata(directory)
    if err:
        return Check.bad(err)
    need = storage_extents(metadata)
    notes: list[str] = []
    if need is None:
        return Check.good([f"{METADATA} has no storage index; shard lengths unchecked"])
    for rel, end in sorted(need.items()):
        shard = directory / rel
        try:
            size = shard.stat().st_size
        except FileNotFoundError:
            return Check.bad(f"shard {rel} listed in {METADATA} is missing")
        except OSError as exc:
            return Check.bad(f"shard {rel} unreadable: {exc}")
        if size < end:
            return Check.bad(f"shard {rel} truncated: {size} bytes, {METADATA} needs {end}")
    listed = set(need)
    extra = sorted(p.name for p in directory.glob("*.distcp") if p.name not in listed)
    if extra:
        notes.append(f"{len(extra)} .distcp file(s) not in {METADATA} (left over from another save): {extra[:3]}")
    return Check.good(notes)


def shards_newer_than_metadata(directory: Path) -> list[str]:
    """Shards modified after .metadata: a later save rewrote them in place and had not finished.

    Only meaningful where a writer overwrites one directory (AReaL); a fresh directory per step never
    shows this. Relies on one clock for all writers (a shared filesystem's server time)."""
    try:
        meta_ns = (directory / METADATA).stat().st_mtime_ns
    except OSError:
        return []
    newer = []
    for shard in directory.glob("*.distcp"):
        try:
            if shard.stat().st_mtime_ns > meta_ns:
                newer.append(shard.name)
        except OSError:
            continue
    return sorted(newer)


def _step_from_name(path: Path) -> int:
    m = _STEP_IN_NAME.search(path.name)
    return int(m.group(1)) if m else 0


def verify_dir(path: Path, step: int | None = None, layout: str = NAME, role: str | None = None) -> CheckpointRecord:
    """Record for one DCP directory; its step comes from the last number in its name (0 if none)."""
    check = check_dcp(path)
    return CheckpointRecord.of_check(check, step=_step_from_name(path) if step is None else step, layout=layout,
                                     path=path, size_bytes=tree_size(path), role=role)


def looks_like(root: Path) -> bool:
    """The root is a DCP itself, or holds DCP directories one level down."""
    return looks_like_dcp(root) or bool(list_steps(root))


def list_steps(root: Path) -> list[tuple[int, Path]]:
    """The root itself when it is a DCP, else each child DCP directory, ascending by step."""
    if looks_like_dcp(root):
        return [(_step_from_name(root), root)]
    out = []
    try:
        children = [c for c in root.iterdir() if c.is_dir()]
    except OSError:
        return []
    for child in children:
        if looks_like_dcp(child):
            out.append((_step_from_name(child), child))
    return sorted(out, key=lambda t: (t[0], t[1].name))


def verify_step(path: Path, step: int | None = None, ctx: Any = None) -> CheckpointRecord:
    return verify_dir(path, step)


def make_context(root: Path) -> None:
    return None
