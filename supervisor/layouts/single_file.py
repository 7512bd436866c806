"""Single-file checkpoints: one file the trainer saves whole each time, usually over the old one
(nanoGPT's ``out/ckpt.pt``, ``model.safetensors``, a script's ``*.ckpt``).

Nothing names a step here, so this module answers two questions only: which files are the
checkpoint (:func:`tracked_files`), and whether one is complete (:func:`check_file`), judged from its
format alone: a ``torch.save`` zip through its central directory, a safetensors file through its
header against the file's size, a pickle (plain, or torch's legacy format) by reading its opcodes to
each STOP without running any of them. A save killed at any byte fails the check. Keeping complete
versions aside and putting one back is :mod:`supervisor.file_versions`' job.
"""

from __future__ import annotations

import fnmatch
import io
import os
import pickletools
import struct
from pathlib import Path

from supervisor.layouts.files import check_safetensors, check_zip
from supervisor.layouts.record import Check

NAME = "single-file"
#: Suffixes auto-detection takes for a checkpoint file (an explicit ``checkpoint_file`` may name any file).
#: Not ``.bin`` or ``.pkl``: beside checkpoints those are as often a trainer's data (nanoGPT's ``train.bin``,
#: ``meta.pkl``), which must never be copied aside, put back or quarantined as a checkpoint.
SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors")
#: Where kept versions live, beside the file (a dot name: globs and "newest file" scans skip it).
VERSIONS_DIR = ".rlsup-versions"
#: The suffix a quarantined torn checkpoint gets (no trainer's own "latest" logic matches it).
INVALID_MARK = ".rlsup-invalid"
_PICKLE_PROTO = 0x80
_LEGACY_PICKLES = 5  # torch's legacy format: magic, protocol, sys_info, the object, the storage keys


def tracked_files(root: Path, pattern: str) -> list[Path]:
    """The checkpoint files under ``root``: those ``pattern`` (a name or glob relative to ``root``)
    matches, or with ``pattern`` empty every top-level regular file with a checkpoint suffix. Dot
    names (rlsup's own, editors' temp files) and quarantined files are never checkpoints."""
    try:
        if pattern:
            candidates = list(root.glob(pattern))
        else:
            candidates = [p for p in root.iterdir() if p.suffix in SUFFIXES]
    except OSError:
        return []
    out = []
    for path in candidates:
        try:
            if _ours_to_skip(path.relative_to(root)) or path.is_symlink() or not path.is_file():
                continue
        except (OSError, ValueError):
            continue
        out.append(path)
    return sorted(out)


def matches(rel: str, pattern: str) -> bool:
    """Whether ``rel`` (a path relative to the checkpoint directory, from rlsup's own records) names a file
    :func:`tracked_files` could return: inside the directory, no dot component, the pattern's shape."""
    path = Path(rel)
    if path.is_absolute() or ".." in path.parts or not path.parts or _ours_to_skip(path):
        return False
    if not pattern:
        return len(path.parts) == 1 and path.suffix in SUFFIXES
    return fnmatch.fnmatch(rel, pattern)


def _ours_to_skip(rel: Path) -> bool:
    """Dot components (rlsup's ``.rlsup-versions``, temp files, hidden directories a glob may enter) and
    quarantined files are never checkpoints."""
    return any(part.startswith(".") for part in rel.parts) or INVALID_MARK in rel.name


def check_file(path: Path) -> Check:
    """Whether ``path`` holds one complete save, by its format; never loads it."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except FileNotFoundError:
        return Check.bad(f"{path.name} missing")
    except OSError as exc:
        return Check.bad(f"{path.name} unreadable: {exc}")
    if not head:
        return Check.bad(f"{path.name} is empty (a save cut before its first byte)")
    if head[:4] == b"PK\x03\x04":
        return check_zip(path)
    if head[0] == _PICKLE_PROTO:
        return _check_pickles(path)
    if len(head) == 8 or path.suffix == ".safetensors":  # an 8-byte header length, then JSON
        return check_safetensors(path)
    return Check.bad(f"{path.name}: not a torch.save zip, safetensors file or pickle (torn or foreign)")


def _check_pickles(path: Path) -> Check:
    """A plain pickle is complete when its opcodes run to STOP and nothing follows; torch's legacy
    format is five pickles (each to its STOP) and then the storages' raw bytes (not checked). Read as
    a stream: a large file is never held in memory."""
    try:
        with open(path, "rb", buffering=1 << 20) as fh:
            return _scan_pickles(fh, os.fstat(fh.fileno()).st_size, path.name)
    except OSError as exc:
        return Check.bad(f"{path.name} unreadable: {exc}")


def _scan_pickles(stream: io.BufferedReader, size: int, name: str) -> Check:
    ends = []
    for _ in range(_LEGACY_PICKLES):
        try:
            for _op, _arg, _pos in pickletools.genops(stream):
                pass  # genops stops after STOP; a cut pickle raises (it never runs an opcode)
        except (ValueError, EOFError, struct.error, UnicodeDecodeError) as exc:
            if ends:  # complete pickles, then a cut one
                return Check.bad(f"{name}: pickle {len(ends) + 1} is cut ({exc})")
            return Check.bad(f"{name}: truncated pickle ({exc})")
        ends.append(stream.tell())
        if stream.tell() == size or stream.peek(1)[:1] != bytes([_PICKLE_PROTO]):
            break
    if len(ends) == 1:
        if ends[0] != size:
            return Check.bad(f"{name}: {size - ends[0]} bytes after the pickle's STOP")
        return Check.good()
    if len(ends) < _LEGACY_PICKLES:
        return Check.bad(f"{name}: torch legacy format cut after {len(ends)} of its {_LEGACY_PICKLES} pickles")
    return Check.good([f"{name}: torch legacy format; its pickles are complete, the storage bytes after them "
                       "are not checked"])
