"""xxh3-128 of checkpoint bytes: the one read-and-hash loop every checker and copier uses."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

import xxhash

#: Read size for hashing and copying: a 100 GB shard costs this much memory.
CHUNK_SIZE = 8 * 1024 * 1024


@dataclass
class FileEntry:
    """Size and checksum of one checkpoint file, as its writer saw it."""

    size: int
    xxh3_128: str


def new_hasher() -> Any:
    """The hash object of the format (for code that hashes bytes as they pass)."""
    return xxhash.xxh3_128()


def copy_hashing(src: BinaryIO | Any, sink: Any = None, throttle: Callable[[int], None] | None = None) -> FileEntry:
    """Read ``src`` (anything with ``read(n)``) to its end, hashing every byte; write each chunk to
    ``sink`` when given; call ``throttle(len(chunk))`` before each chunk (a bandwidth limit).
    Returns what was read: its size and xxh3-128."""
    h = xxhash.xxh3_128()
    size = 0
    readinto = getattr(src, "readinto", None)
    if readinto is not None:
        buf = bytearray(CHUNK_SIZE)
        view = memoryview(buf)
        while True:
            n = readinto(buf)
            if not n:
                break
            chunk = view[:n]
            if throttle is not None:
                throttle(n)
            h.update(chunk)
            if sink is not None:
                sink.write(chunk)
            size += n
        return FileEntry(size, h.hexdigest())
    while True:
        chunk = src.read(CHUNK_SIZE)
        if not chunk:
            break
        if throttle is not None:
            throttle(len(chunk))
        h.update(chunk)
        if sink is not None:
            sink.write(chunk)
        size += len(chunk)
    return FileEntry(size, h.hexdigest())


def hash_fd(fd: int) -> FileEntry:
    """Size and xxh3-128 of an open file from its current offset to its end (the fd stays open)."""
    with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
        return copy_hashing(f)


def hash_file(path: str | os.PathLike, throttle: Callable[[int], None] | None = None) -> FileEntry:
    """Size and xxh3-128 of a file, streamed."""
    with open(path, "rb", buffering=0) as f:
        return copy_hashing(f, throttle=throttle)
