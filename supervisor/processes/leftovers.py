"""End what an attempt left when its rlsup is gone: the run's cgroup, the job roots' sessions, and
every pid rlsup recorded, each checked against its start time.

Used by the guardian the moment rlsup dies (:mod:`supervisor.processes.guardian`), by a successor rlsup
before it launches (``Supervisor.first_attempt``), and by rlsup itself at the end of a run. A pid
whose start time does not match the record is never signalled (the pid was reused). A session is
ended only while its leader is gone or still the recorded root (a session id is the leader's pid, so
a reused pid leading a new session leaves that session alone). Standard library only.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from supervisor.processes.cgroup import kill_cgroup, remove_cgroup
from supervisor.processes.tree_record import ProcRef, TreeRecord, all_pids, proc_session, proc_start


@dataclass(frozen=True)
class Ended:
    """One process ended, and how it was found (``cgroup``, ``session <sid>``, ``recorded``)."""

    pid: int
    how: str

    def __str__(self) -> str:
        return f"{self.pid} ({self.how})"


def _session_members(record: TreeRecord, spare: set[int]) -> dict[int, str]:
    """Live pids in the recorded roots' sessions (started no earlier than their root)."""
    sessions = {}
    for root in record.roots:
        leader = proc_start(root.pid)
        if leader is None or leader == root.start:
            sessions[root.pid] = root.start
    if not sessions:
        return {}
    found = {}
    for pid in all_pids():
        if pid in spare:
            continue
        info = proc_session(pid)
        if info is not None and info[0] in sessions and info[1] >= sessions[info[0]]:
            found[pid] = f"session {info[0]}"
    return found


def _recorded(record: TreeRecord, spare: set[int]) -> dict[int, str]:
    refs = [ProcRef(r.pid, r.start) for r in record.roots] + list(record.pids)
    return {ref.pid: "recorded" for ref in refs if ref.pid not in spare and ref.matches()}


def end_leftovers(record: TreeRecord, passes: int = 5, cgroup: bool = True) -> list[Ended]:
    """SIGKILL everything of ``record``'s attempts that still lives; what was ended. ``cgroup`` False
    skips the cgroup (the fallback alone, as where none could be made)."""
    spare = {os.getpid(), record.owner.pid}
    ended: dict[int, str] = {}
    if cgroup and record.cgroup:
        for pid in kill_cgroup(Path(record.cgroup)):
            ended.setdefault(pid, "cgroup")
    for _ in range(passes):  # a process forking while we kill: each pass takes its new children too
        alive = {**_recorded(record, spare), **_session_members(record, spare)}
        if not alive:
            break
        for pid, how in alive.items():
            try:
                os.kill(pid, signal.SIGKILL)
                ended.setdefault(pid, how)
            except (ProcessLookupError, PermissionError):
                pass
        _wait_gone(list(alive), 1.0)
    if cgroup and record.cgroup:
        remove_cgroup(Path(record.cgroup))
    return [Ended(pid, how) for pid, how in sorted(ended.items())]


def _wait_gone(pids: list[int], timeout: float) -> None:
    """Until every pid is dead (gone or a zombie) or ``timeout``; SIGKILL is quick but asynchronous."""
    deadline = time.monotonic() + timeout
    while any(proc_start(pid) is not None for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
