"""A thread whose descriptor table is its own, for file I/O on a shared filesystem that may hang.

Each close of a descriptor on FUSE or NFS sends a flush to the server. A child forked by rlsup (the next
attempt's launch, the warm launcher, py-spy) inherits rlsup's descriptors and closes them at exec; while one of
rlsup's threads holds a file open on a hung mount, that close waits for the mount, and so does
``subprocess.Popen``, which waits for the exec. So the persistent tier's threads call :func:`enter` first:
``unshare(CLONE_FILES)`` gives the calling thread (and the threads it starts) a private copy of the table, the
files they open are never in the table a fork copies, and the table's copies of pipes and sockets are closed at
once (a copy kept there would hold a pipe's other end open, or a connection, after their owner closed them).
Directory descriptors and ``stat`` need none of this: closing a directory sends no flush.

Regular files already open stay in the copy (stderr, which logging writes, among them), so a number such a
thread reuses never aliases one that another thread's object still uses. Where ``unshare`` is refused
(seccomp, not Linux) the thread goes on with the shared table, as before, and says so once.
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat
import threading
from typing import Callable, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
CLONE_FILES = 0x400
_state = threading.local()
_refused: list[str] = []


def private() -> bool:
    """Whether the calling thread already has its own descriptor table (from :func:`enter`)."""
    return bool(getattr(_state, "private", False))


def enter() -> bool:
    """Give the calling thread its own descriptor table (see the module docstring); True when it has one."""
    if private():
        return True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_FILES) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as e:
        if not _refused:
            _refused.append(str(e))
            log.warning("a private descriptor table was refused (%s): a fork while a tier file is open on a hung "
                        "mount can block", e)
        return False
    _state.private = True
    _close_pipes_and_sockets()
    return True


def _close_pipes_and_sockets() -> None:
    try:
        fds = [int(n) for n in os.listdir("/proc/thread-self/fd")]
    except OSError:
        return
    for fd in fds:
        try:
            if fd > 2 and (stat.S_ISFIFO(mode := os.fstat(fd).st_mode) or stat.S_ISSOCK(mode)):
                os.close(fd)  # this table's copy only: the owner's descriptor is untouched
        except OSError:
            continue  # the listing's own descriptor, gone by now


def run(fn: Callable[[], T]) -> T:
    """``fn()`` in a thread with its own descriptor table, waited for (the caller's thread when it has one)."""
    if private():
        return fn()
    box: list[tuple[bool, object]] = []

    def body() -> None:
        enter()
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            box.append((False, e))

    thread = threading.Thread(target=body, name=f"{threading.current_thread().name}-files", daemon=True)
    thread.start()
    thread.join()
    ok, value = box[0]
    if not ok:
        raise value  # type: ignore[misc]
    return value  # type: ignore[return-value]
