"""Durable and safe file operations: directory fsync, no-follow open, atomic write, tree removal.

Why no-follow: a checkpoint's data files and manifests are never symlinks; following one would
verify, copy or load whatever it points at (another step's shard, a file outside the checkpoint dir).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path
from typing import Any, Sequence

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: opening a FIFO planted where a file should be must not block; O_NOCTTY: nor grab a tty.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | _CLOEXEC
_SUBDIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC


class UnsafeFileError(OSError):
    """A checkpoint file (or a directory on its way) that is a symbolic link, or not a regular file:
    never followed, never read. ``strerror`` says which."""


#: What a filesystem that cannot sync a directory answers (some FUSE and network mounts): there the
#: rename is as durable as that filesystem makes it, and refusing every write would help nobody.
_DIR_FSYNC_UNSUPPORTED = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make renames/creations inside ``path`` durable (a rename is only safe once its dir is synced)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        fsync_dir_fd(fd)
    finally:
        os.close(fd)


def fsync_dir_fd(fd: int) -> None:
    """fsync an open directory; a filesystem that does not support it is not an error."""
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise


def fsync_dirs(paths: set[Path] | list[Path]) -> None:
    """fsync each directory once, deepest first (a new subdirectory before the parent that names it)."""
    for d in sorted(set(paths), key=lambda p: len(Path(p).parts), reverse=True):
        fsync_dir(d)


def open_nofollow(base: str | os.PathLike, name: str) -> int:
    """A read-only fd (caller closes) of ``base/name`` that is a regular file reached without following
    any symbolic link below ``base`` (``name`` is '/'-separated, relative; ``base`` itself is opened
    as given). FileNotFoundError when absent, :class:`UnsafeFileError` for a symlink or a non-regular
    file."""
    parts = name.split("/")
    dfd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        for part in parts[:-1]:
            try:
                nfd = os.open(part, _SUBDIR_FLAGS, dir_fd=dfd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeFileError(e.errno, f"directory {part!r} on its path is a symbolic link "
                                                   "or not a directory (not followed)") from None
                raise
            os.close(dfd)
            dfd = nfd
        return open_regular_at(dfd, parts[-1])
    finally:
        os.close(dfd)


def open_regular_at(dir_fd: int, name: str) -> int:
    """A blocking read-only fd (caller closes) of the regular file ``name`` in the open directory
    ``dir_fd``, never through a symlink: FileNotFoundError when absent, :class:`UnsafeFileError` for a
    symlink or anything but a regular file (a FIFO planted there cannot block the open)."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFileError(errno.ELOOP, "a symbolic link (not followed)") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeFileError(errno.EINVAL, "not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_nofollow(base: str | os.PathLike, name: str) -> bytes:
    """The bytes of ``base/name``, opened as :func:`open_nofollow` does (for manifests)."""
    with os.fdopen(open_nofollow(base, name), "rb") as f:
        return f.read()


def write_durable(path: str | os.PathLike, data: bytes, tmp: str | os.PathLike) -> None:
    """Write ``data`` to ``tmp``, fsync it, rename it to ``path`` and fsync the directory: the file is
    either absent, the old one, or whole. ``tmp`` (a reserved name, see :mod:`rlsup_format.names`)
    must be in the same directory; it is removed on failure."""
    path = Path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def fsync_file(path: str | os.PathLike) -> None:
    """fsync a file that is already written (a backend wrote it without syncing)."""
    fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` at ``offset`` of ``fd`` to disk now, without waiting
    (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``): a large file's data then reaches the disk while
    the rest is still being serialized, and its one fsync at the end waits for the tail only. No
    durability is promised by it (the fsync still does that); elsewhere it does nothing."""
    global _sync_file_range
    if _sync_file_range is None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.sync_file_range
            fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
            _sync_file_range = fn
        except (OSError, AttributeError):
            _sync_file_range = False
    if _sync_file_range:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def writev_all(fd: int, chunks: Sequence[bytes | bytearray | memoryview]) -> None:
    """Write every byte of ``chunks`` in order (``writev`` may write less than asked, or be capped)."""
    views = [memoryview(c) for c in chunks if len(c)]
    while views:
        batch = views[:_IOV_MAX]
        w = os.writev(fd, batch)
        for i, v in enumerate(batch):
            if w < len(v):
                views = [v[w:], *views[i + 1:]]
                break
            w -= len(v)
        else:
            views = views[len(batch):]


def remove_path(path: str | os.PathLike) -> None:
    """Remove a file or a whole directory tree (never following a symlink); absent is fine."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except (FileNotFoundError, IsADirectoryError):
            pass


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host. Unknown (<= 0) counts as alive: only age may make its
    leftovers stale (and ``kill(-1, 0)`` would mean "every process")."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """A writer that ended and waits to be reaped (its parent killed, an init that reaps late) is gone: what it
    left is left over. Unknown (no /proc) counts as not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] == b"Z"
