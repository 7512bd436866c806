"""Single-file checkpoints: one file the trainer saves whole each time, usually over the old one
(nanoGPT's ``out/ckpt.pt``, ``model.safetensors``, a script's ``*.ckpt``).

Nothing in the file names a step, so this module answers: which files are the checkpoint
(:func:`tracked_files`: those rewritten in place, whose versions are kept; :func:`checkpoint_files`: those
plus, found by ``auto``, litgpt's one file per step directory), which one is newest and complete
(:func:`scan`, :func:`latest_valid`, :func:`torn_newest`: what ``rlsup run`` resumes from and what
``rlsup checkpoints`` lists), and whether one is complete (:func:`check_file`), judged from its format alone: a ``torch.save`` zip through its central directory, a safetensors file through its
header against the file's size, a pickle (plain, or torch's legacy format) by reading its opcodes to
each STOP without running any of them. A save killed at any byte fails the check. Keeping complete
versions aside and putting one back is :mod:`supervisor.run.file_versions`' job.
"""

from __future__ import annotations

import fnmatch
import io
import os
import pickletools
import re
import struct
from pathlib import Path

from supervisor.layouts.files import check_safetensors, check_zip
from supervisor.layouts.record import Check, CheckpointRecord

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
_LAST_NUMBER = re.compile(r"(\d+)\D*$")
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


def step_dir_files(root: Path) -> list[Path]:
    """One checkpoint file per step directory (litgpt's ``step-00000070/lit_model.pth``): the files with a
    checkpoint suffix directly inside a top-level directory whose name holds a number. Each is written once,
    in a new directory, so its versions are not kept (:mod:`supervisor.run.file_versions` keeps versions of a
    file rewritten in place only: a copy of a file never written again would buy nothing and double the
    disk)."""
    try:
        dirs = [d for d in root.iterdir() if _LAST_NUMBER.search(d.name) and not _ours_to_skip(Path(d.name))
                and not d.is_symlink() and d.is_dir()]
    except OSError:
        return []
    out = []
    for d in dirs:
        try:
            out.extend(p for p in d.iterdir() if p.suffix in SUFFIXES and not _ours_to_skip(Path(d.name, p.name))
                       and not p.is_symlink() and p.is_file())
        except OSError:
            continue
    return sorted(out)


def checkpoint_files(root: Path, pattern: str) -> list[Path]:
    """The single-file checkpoints rlsup reads under ``root``: those ``pattern`` matches; with ``pattern``
    empty, the top-level files :func:`tracked_files` takes, or where there are none, litgpt's shape
    (:func:`step_dir_files`). Callers take ``auto`` only while no other layout recognises ``root``."""
    return tracked_files(root, pattern) or ([] if pattern else step_dir_files(root))


def step_in_name(root: Path, path: Path) -> int | None:
    """The last number in the name of ``path``'s directory under ``root`` (``step-00000070``), else in the
    file's own stem (``ckpt_100.pt``); None where neither has one (nanoGPT's ``ckpt.pt``). A label for the
    listing, never what a resume claims (the trainer's own steps may count otherwise)."""
    try:
        rel = path.relative_to(root)
    except ValueError:
        rel = Path(path.name)
    for name in (*reversed(rel.parts[:-1]), rel.stem):
        m = _LAST_NUMBER.search(name)
        if m:
            return int(m.group(1))
    return None


def _mtime_ns(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def newest_first(files: list[Path]) -> list[Path]:
    """Newest save first: by modification time, as a "newest file wins" trainer picks (one order for the
    resume choice, the listing, the quarantine and the launch line's warning)."""
    return sorted(files, key=lambda p: (_mtime_ns(p), str(p)), reverse=True)


def record_of(root: Path, path: Path) -> CheckpointRecord:
    """One file as a catalogue record (step: the number in its name, -1 where it has none)."""
    return CheckpointRecord.of_check(check_file(path), step=step_in_name(root, path), layout=NAME, path=path,
                                     size_bytes=_size(path))


def scan(root: Path, pattern: str) -> list[CheckpointRecord]:
    """Every single-file checkpoint under ``root``, checked, oldest first (``rlsup checkpoints list``)."""
    return [record_of(root, p) for p in reversed(newest_first(checkpoint_files(root, pattern)))]


def latest_valid(root: Path, pattern: str) -> CheckpointRecord | None:
    """The newest complete file, checking newest first and stopping at the first complete one (what
    ``rlsup run`` resumes from and ``rlsup checkpoints latest`` names)."""
    for path in newest_first(checkpoint_files(root, pattern)):
        record = record_of(root, path)
        if record.valid:
            return record
    return None


def torn_newest(root: Path, pattern: str) -> list[CheckpointRecord]:
    """The files newer than the newest complete one that fail the check, newest first: what a trainer that
    loads its newest file itself would wrongly load."""
    torn = []
    for path in newest_first(checkpoint_files(root, pattern)):
        record = record_of(root, path)
        if record.valid:
            break
        torn.append(record)
    return torn


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
