"""A whole-step fetch from the persistent tier lands in a private staging directory first, and moves into the
checkpoint directory only while its caller still wants it.

A restart reads the tier in a bounded call (:mod:`supervisor.bounded_calls`): past the deadline the restart
goes on from an older step and the fetch is left running, since a thread blocked on a hung mount cannot be
stopped. Were it to write ``step_N`` into the checkpoint directory when the mount answers again, the new
attempt could later save the same step N beside it: one step with parts of two runs. So the fetch copies into
``<checkpoint_dir>/.rlsup-fetch-<pid>-<n>/`` (a name no layout reads), and the caller's give-up and the move into
place are decided under one lock: an abandoned fetch removes its staging directory and leaves nothing.
"""

from __future__ import annotations

import itertools
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = ".rlsup-fetch-"
_numbers = itertools.count()


@dataclass
class FetchTicket:
    """Whether the fetch's caller still wants its result; :meth:`cancel` once it has gone on without it."""

    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def cancel(self) -> None:
        with self.lock:  # waits for a move into place in progress: afterwards nothing more appears
            self.cancelled = True


def staging_dir(dest_dir: str | os.PathLike) -> Path:
    """A new private staging directory's path in ``dest_dir`` (not created)."""
    return Path(dest_dir) / f"{PREFIX}{os.getpid()}-{next(_numbers)}"


def remove_stale(dest_dir: str | os.PathLike) -> None:
    """Staging directories of rlsup processes no longer running (killed mid-fetch)."""
    try:
        entries = list(os.scandir(dest_dir))
    except (FileNotFoundError, NotADirectoryError):
        return
    for e in entries:
        if e.name.startswith(PREFIX) and not _alive(e.name[len(PREFIX):].split("-")[0]):
            shutil.rmtree(e.path, ignore_errors=True)


def place(staged: Path, dest: Path, ticket: FetchTicket | None) -> bool:
    """Move the staged step directory ``staged`` to ``dest`` (replacing an incomplete one there) unless the
    ticket was cancelled; the staging directory is removed either way. Whether it was placed."""
    root = staged.parent
    try:
        with ticket.lock if ticket is not None else _NO_LOCK:
            if ticket is not None and ticket.cancelled:
                return False
            if dest.exists():  # the tier's copy verified: it replaces what an earlier run left incomplete
                old = root / "replaced"
                os.rename(dest, old)
            os.rename(staged, dest)
            return True
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_LOCK = _NoLock()
