"""Removing what killed writers left behind: the one cleaner for every reserved name.

The rule (:func:`is_stale`): an entry named by :mod:`rlsup_format.names` is left over when its
writer is a process of this host that is gone, or when it is older than ``stale_age`` seconds (a
writer on another host cannot be checked from here; a live writer keeps a temp file's mtime fresh).
Hold markers are removed only in the first case: a long copy on another host must keep its step.
An entry of this very process is never removed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from rlsup_format.fileio import pid_alive, remove_path
from rlsup_format.names import Kind, Reserved, host_tag, parse_reserved

#: Reserved entries older than this are removed even when their pid cannot be checked (other hosts).
STALE_AGE_S = 3600.0


def is_stale(res: Reserved, age: float, stale_age: float | None = STALE_AGE_S) -> bool:
    """Whether the entry ``res`` (``age`` seconds since its last change) may be removed."""
    if res.mine():
        return False
    if res.host == host_tag() and res.pid != os.getpid() and not pid_alive(res.pid):
        return True
    return res.kind is not Kind.HOLD and stale_age is not None and age > stale_age


def clean_leftovers(directory: str | os.PathLike, kinds: frozenset[Kind] | set[Kind] = frozenset(Kind),
                    stale_age: float | None = STALE_AGE_S, recursive: bool = False,
                    now: float | None = None) -> list[Path]:
    """Remove the stale reserved entries of ``kinds`` in ``directory`` (and, ``recursive``, in its
    non-reserved subdirectories); returns what was removed. ``stale_age=None``: only dead writers
    of this host count. Never raises for a vanished entry."""
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for e in entries:
        res = parse_reserved(e.name)
        if res is None:
            if recursive and not e.name.startswith(".") and e.is_dir(follow_symlinks=False):
                removed += clean_leftovers(e.path, kinds, stale_age, True, now)
            continue
        if res.kind not in kinds:
            continue
        try:
            age = now - e.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        if is_stale(res, age, stale_age):
            remove_path(e.path)
            removed.append(Path(e.path))
    return removed
