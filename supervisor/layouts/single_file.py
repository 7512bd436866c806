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
import pickletools
import struct
from pathlib import Path

from supervisor.layouts.files import check_safetensors, check_zip
from supervisor.layouts.record import Check

NAME = "single-file"
#: Suffixes auto-detection takes for a checkpoint file (an explicit ``checkpoint_file`` may name any file).
SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".safetensors", ".pkl")
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
        if path.name.startswith(".") or INVALID_MARK in path.name:
            continue
        try:
            if path.is_file():
                out.append(path)
        except OSError:
            continue
    return sorted(out)


def matches(path: Path, root: Path, pattern: str) -> bool:
    """Whether ``path`` is one of the files :func:`tracked_files` would return (by name only)."""
    if path.name.startswith(".") or INVALID_MARK in path.name:
        return False
    if not pattern:
        return path.parent == root and path.suffix in SUFFIXES
    try:
        return fnmatch.fnmatch(str(path.relative_to(root)), pattern)
    except ValueError:
        return False


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
    format is five pickles (each to its STOP) and then the storages' raw bytes."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return Check.bad(f"{path.name} unreadable: {exc}")
    stream = io.BytesIO(data)
    ends = []
    for _ in range(_LEGACY_PICKLES):
        try:
            for _op, _arg, _pos in pickletools.genops(stream):
                pass  # genops stops after STOP; a cut pickle raises (it never runs an opcode)
        except (ValueError, EOFError, struct.error, UnicodeDecodeError) as exc:
            if ends:  # complete pickles, then a cut one
                return Check.bad(f"{path.name}: pickle {len(ends) + 1} is cut ({exc})")
            return Check.bad(f"{path.name}: truncated pickle ({exc})")
        ends.append(stream.tell())
        if stream.tell() == len(data):
            break
        if stream.read(1)[:1] != bytes([_PICKLE_PROTO]):
            stream.seek(-1, io.SEEK_CUR)
            break
        stream.seek(-1, io.SEEK_CUR)
    if len(ends) == 1:
        if ends[0] != len(data):
            return Check.bad(f"{path.name}: {len(data) - ends[0]} bytes after the pickle's STOP")
        return Check.good()
    if len(ends) < _LEGACY_PICKLES:
        return Check.bad(f"{path.name}: torch legacy format cut after {len(ends)} of its {_LEGACY_PICKLES} pickles")
    return Check.good([f"{path.name}: torch legacy format; its pickles are complete, the storage bytes after them "
                       "are not checked"])
