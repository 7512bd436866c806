"""The 'latest step' tracker files verl, Megatron and DeepSpeed keep at the checkpoint root: read and repair.

Both trainers write ``latest_checkpointed_iteration.txt`` with a plain ``open("w")`` (no temp file,
no fsync), so it can be empty or torn after a crash; retention can leave it naming a deleted step.
DeepSpeed's rank 0 overwrites ``latest`` (the tag name) in place the same way, before the final barrier.
Reading never raises. Repair writes a temp file (a reserved name, :mod:`rlsup_format.names`), fsyncs
it, renames it over the tracker and fsyncs the directory, keeping the previous content beside it as
``<name>.rlsup-prev``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rlsup_format.fileio import fsync_dir, fsync_file, write_durable
from rlsup_format.names import Kind, reserved_name

TRACKER = "latest_checkpointed_iteration.txt"
BRIDGE_TRACKER = "latest_train_state.pt"
PREV_SUFFIX = ".rlsup-prev"


def read_stripped(path: Path, empty: str = "empty (torn write)") -> tuple[str | None, str | None, str | None]:
    """(stripped text, raw text, error) of a one-line tracker file, read as the trainers do
    (``read().strip()``); ``error`` for a missing, unreadable or empty file (``empty`` says why). Never raises."""
    try:
        raw = path.read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None, None, "missing"
    except OSError as exc:
        return None, None, f"unreadable: {exc}"
    text = raw.strip()
    return (text, raw, None) if text else (None, raw, empty)


def read_tracker(path: Path) -> tuple[int | None, str | None, str | None]:
    """(step, raw text, error). ``error`` is set for missing, empty, torn or non-integer content."""
    text, raw, error = read_stripped(path)
    if text is None:
        return None, raw, error
    if text == "release":
        return None, raw, "names 'release', not a step"
    try:
        step = int(text)
    except ValueError:
        return None, raw, f"not an integer: {text[:40]!r}"
    if step < 0:
        return None, raw, f"negative step {step}"
    return step, raw, None


def _temp_beside(path: Path) -> Path:
    return path.with_name(reserved_name(Kind.TMP, path.name))


def atomic_write(path: Path, data: bytes) -> None:
    """temp file in the same directory, fsync, rename over ``path``, fsync the directory."""
    write_durable(path, data, _temp_beside(path))


def keep_previous(path: Path) -> Path | None:
    """Copy the current content of ``path`` to ``<name>.rlsup-prev`` (atomically); None if absent."""
    if not path.exists():
        return None
    prev = path.with_name(path.name + PREV_SUFFIX)
    atomic_write(prev, path.read_bytes())
    return prev


def write_tracker(path: Path, step: int) -> Path | None:
    """Point ``path`` at ``step`` the way verl and Megatron write it (the bare number); returns the
    ``.rlsup-prev`` backup path, or None when there was no old tracker."""
    prev = keep_previous(path)
    atomic_write(path, str(int(step)).encode())
    return prev


def write_deepspeed_latest(paths: list[Path], tag: str) -> list[Path | None]:
    """Point DeepSpeed's ``latest`` file(s) (one per OpenRLHF role) at ``tag``: the bare tag, as
    ``save_checkpoint`` writes it, but atomically; returns the ``.rlsup-prev`` backups."""
    if not tag or "/" in tag or tag.strip() != tag:
        raise ValueError(f"not a DeepSpeed tag: {tag!r}")
    prevs = []
    for path in paths:
        prevs.append(keep_previous(path))
        atomic_write(path, tag.encode())
    return prevs


def copy_atomically(src: Path, dst: Path) -> Path | None:
    """Replace ``dst`` by a copy of ``src`` (Bridge's latest_train_state.pt), keeping the old one."""
    prev = keep_previous(dst)
    tmp = _temp_beside(dst)
    try:
        shutil.copyfile(src, tmp)
        fsync_file(tmp)
        os.replace(tmp, dst)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(dst.parent)
    return prev
