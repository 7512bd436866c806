"""One rlsup per directory: a second job that would share a state or replica directory refuses to start.

Two jobs started from one working directory share the relative defaults (``.rlsup``, ``replicas``):
their ``state.json`` would overwrite each other and one would serve the other's replicas. An advisory
``flock`` on a file in the directory says who holds it; the kernel drops it when the holder dies
(SIGKILL included), so a crashed rlsup never blocks its successor. The fd is close-on-exec, so the job's
processes never inherit the lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path


class DirInUse(RuntimeError):
    """Another live rlsup holds the directory; the message names the directory, its job and pid."""


class DirLock:
    """Held for the life of the process that takes it (or until :meth:`release`)."""

    def __init__(self, directory: str | os.PathLike, name: str, what: str, job: str) -> None:
        self.path = Path(directory) / name
        self.what, self.job = what, job
        self._fd: int | None = None

    def acquire(self) -> "DirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise DirInUse(f"{self.what} {self.path.parent} is in use by rlsup job {holder.get('job', '?')!r} "
                           f"(pid {holder.get('pid', '?')} on {holder.get('host', '?')}); this is job "
                           f"{self.job!r}: give each job its own {self.what}") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"job": self.job, "pid": os.getpid(), "host": socket.gethostname()}).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
