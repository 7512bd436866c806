"""xxh3-128 of checkpoint bytes: the one read-and-hash loop every checker and copier uses (and a mapped
variant for the files a writer alone owns)."""

from __future__ import annotations

import mmap
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


def hash_own_file(path: str | os.PathLike) -> FileEntry:
    """Size and xxh3-128 of a file that only the caller writes (a save's own staging file), hashed
    through a read-only mapping: no copy into a buffer, which on a tmpfs (the memory tier) is the whole
    cost of reading. Only for files nobody can truncate meanwhile (that would raise SIGBUS); anything
    shared is hashed with :func:`hash_file`."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return FileEntry(0, xxhash.xxh3_128().hexdigest())
        h = xxhash.xxh3_128()
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                for start in range(0, size, CHUNK_SIZE):
                    h.update(view[start:start + CHUNK_SIZE])
            finally:
                view.release()
        return FileEntry(size, h.hexdigest())
