"""One cgroup (v2) per rlsup run, one child group per job root: the whole tree ends as a unit.

A process cannot leave a cgroup by daemonising (setsid, double fork) the way it leaves a session or
the parent/child tree, so killing the group reaches everything an attempt started. Where cgroup2 is
mounted (pure v2 at /sys/fs/cgroup; a hybrid host mounts it at /sys/fs/cgroup/unified) and rlsup may
create a group below its own, the run gets ``<own cgroup>/rlsup.<pid>.<start>``; no controller is
enabled, so no limit changes and the groups the job lived in (slurm's, systemd's) still account it.
Where none can be made (no cgroup2, no permission) :func:`create_run_cgroup` returns None and rlsup
falls back on sessions and recorded pids (:mod:`supervisor.processes.leftovers`).
Standard library only (the guardian imports it).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def cgroup2_mount() -> Path | None:
    """Where the unified (v2) hierarchy is mounted, from ``/proc/self/mountinfo``."""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                if right.split(" ", 1)[0] == "cgroup2":
                    return Path(left.split()[4])
    except OSError:
        pass
    return None


def own_cgroup() -> str | None:
    """This process's v2 group (the ``0::`` line of ``/proc/self/cgroup``)."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        pass
    return None


def create_run_cgroup(name: str) -> Path | None:
    """A new group ``name`` below rlsup's own, usable for job roots; None where cgroup v2 does not allow it."""
    mount, own = cgroup2_mount(), own_cgroup()
    if mount is None or own is None:
        return None
    path = mount / own.lstrip("/") / name
    try:
        path.mkdir()
    except FileExistsError:
        pass
    except OSError:
        return None
    if not (path / "cgroup.procs").exists():
        remove_cgroup(path)
        return None
    return path


def child_cgroup(run: Path, name: str) -> Path | None:
    """A job root's own group in the run's; None if it cannot be made (the root runs in rlsup's group)."""
    path = run / name
    try:
        path.mkdir(exist_ok=True)
    except OSError:
        return None
    return path


def join_cgroup(path: str) -> None:
    """Move the calling process into ``path`` (between fork and exec: before the job can fork)."""
    fd = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY)
    try:
        os.write(fd, b"0")
    finally:
        os.close(fd)


def cgroup_pids(path: Path) -> list[int]:
    """Every process in ``path`` and its descendant groups."""
    pids: list[int] = []
    for dirpath, _dirs, _files in os.walk(path):
        try:
            with open(os.path.join(dirpath, "cgroup.procs")) as f:
                pids.extend(int(line) for line in f if line.strip())
        except (OSError, ValueError):
            continue
    return pids


def kill_cgroup(path: Path, timeout: float = 2.0) -> list[int]:
    """SIGKILL everything in ``path`` (``cgroup.kill``, Linux 5.14+; else each pid until none is left);
    the pids that were in it. Waits up to ``timeout`` for the group to empty."""
    if not path.is_dir():
        return []
    before = cgroup_pids(path)
    if not before:
        return []
    killer = path / "cgroup.kill"
    deadline = time.monotonic() + timeout
    while True:
        try:
            killer.write_text("1")
        except OSError:
            for pid in cgroup_pids(path):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if not cgroup_pids(path) or time.monotonic() > deadline:
            return before
        time.sleep(0.002)  # the restart path waits here: the next attempt needs the memory (GPU) freed


def remove_cgroup(path: Path, timeout: float = 1.0) -> bool:
    """Remove ``path`` and its child groups; True when gone. A group empties a moment after its last
    process is killed (``cgroup.procs`` hides exiting tasks first), so a busy one is retried briefly."""
    deadline = time.monotonic() + timeout
    while path.is_dir():
        for child in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            try:
                child.rmdir()
            except OSError:
                pass
        try:
            path.rmdir()
        except OSError:
            if time.monotonic() > deadline or not path.is_dir():
                break
            time.sleep(0.01)
    return not path.is_dir()
