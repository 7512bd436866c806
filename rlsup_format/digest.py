"""xxh3-128 of checkpoint bytes: the one read-and-hash loop every checker and copier uses, a mapped
variant for the files a writer alone owns, and a write-through file that hashes what a serializer
writes as it passes (so a save never reads its own bytes back)."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

import xxhash

from rlsup_format.fileio import start_writeback

#: Read size for hashing and copying: a 100 GB shard costs this much memory.
CHUNK_SIZE = 8 * 1024 * 1024
#: A :class:`HashingWriter` starts the disk writing its data every this many bytes.
WRITEBACK_EVERY = 16 * 1024 * 1024


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


class HashingWriter:
    """A new file, written through: every byte passed to :meth:`write` is hashed and written at once,
    so its :class:`FileEntry` is known when the writer finishes, without reading the file back.

    Made for serializers that take a file object (``torch.save(obj, writer)`` hands each tensor's
    storage over as one memoryview: hashed and written without a copy). ``close()`` fsyncs once, the
    only fsync the file gets; after it :attr:`entry` holds its size and xxh3-128. Created with
    ``O_EXCL``: it never writes into a file that already exists."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                           0o644)
        self._hash = xxhash.xxh3_128()
        self.size = 0
        self._kicked = 0  # bytes whose writeback was started
        self.entry: FileEntry | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        self._hash.update(view)
        while view:
            done = os.write(self._fd, view[:WRITEBACK_EVERY])
            view = view[done:]
            self.size += done
            if self.size - self._kicked >= WRITEBACK_EVERY:  # the disk starts on it while the rest is written
                start_writeback(self._fd, self._kicked, self.size - self._kicked)
                self._kicked = self.size
        return n

    def tell(self) -> int:
        return self.size

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False  # serializers then write sequentially (the hash is of the bytes in order)

    def flush(self) -> None:
        """Nothing is buffered: every write went straight to the file."""

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        """fsync (once) and close; :attr:`entry` is set from here on."""
        if self._fd < 0:
            return
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1
        self.entry = FileEntry(self.size, self._hash.hexdigest())

    def abort(self) -> None:
        """Close without an entry (the file is left for the caller's cleanup)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "HashingWriter":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
