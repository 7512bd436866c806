"""Test files: made to a size, and compared by identity (inode, size, mtime)."""

from __future__ import annotations

from pathlib import Path

import xxhash

from rlsup_format.manifest import FileEntry, hash_file


def make_file(path: Path, size: int, seed: int = 0) -> FileEntry:
    """A file of ``size`` bytes whose content depends on ``seed``; returns its manifest entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    block = xxhash.xxh3_128_digest(str(seed).encode()) * 4096  # 64 KiB, cheap to make
    with open(path, "wb") as f:
        left = size
        while left:
            f.write(block[:min(left, len(block))])
            left -= min(left, len(block))
    return hash_file(path)


def file_stat(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime_ns) of ``path``, None when it is not there: changes when a save rewrites it."""
    try:
        s = path.stat()
    except FileNotFoundError:
        return None
    return s.st_ino, s.st_size, s.st_mtime_ns
