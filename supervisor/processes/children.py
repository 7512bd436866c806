"""A process's children from the kernel's per-thread ``children`` files, not from a scan of every process.

rlsup refreshes the job's process tree every ``poll_interval`` (0.1 s). ``psutil.Process.children`` builds
a parent map from ``/proc/<pid>/stat`` of *every* process on the host each call, so the watch's cost grew
with the host's process count: an idle single-node run used about 4 % of a core here, most of it in that
scan. ``/proc/<pid>/task/<tid>/children`` (Linux 3.5+, ``CONFIG_PROC_CHILDREN``, on in the distribution
kernels) lists one thread's children, so a walk costs a small read per thread of the job's own processes.
Where the kernel has no such file, :func:`children` returns None and the caller uses psutil as before.
Standard library only.
"""

from __future__ import annotations

import os

#: Whether this kernel has the per-thread children files (checked once, on this process's main thread).
AVAILABLE = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def children(pid: int) -> list[int] | None:
    """The pids whose parent is ``pid`` (any of its threads); [] when ``pid`` is gone; None: no such files, or
    they cannot be read (the caller then walks with psutil)."""
    if not AVAILABLE:
        return None
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return []  # gone
    except OSError:
        return None  # cannot read it (out of descriptors, denied): the caller's psutil walk says
    found: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found.extend(int(p) for p in f.read().split())
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue  # the thread ended meanwhile
        except OSError:
            return None
    return found


def descendants(pid: int) -> list[int] | None:
    """Every pid below ``pid``; None where the kernel has no children files or one cannot be read."""
    if not AVAILABLE:
        return None
    out: list[int] = []
    queue = [pid]
    seen = {pid}
    while queue:
        below = children(queue.pop())
        if below is None:
            return None
        for child in below:
            if child not in seen:  # a pid reused while we walked cannot loop us
                seen.add(child)
                out.append(child)
                queue.append(child)
    return out


__all__ = ["AVAILABLE", "children", "descendants"]
