"""Seeing a rank die the moment it dies, without waiting for its launcher to notice.

A rank is a child of the launcher (torchrun's agent), not of rlsup, so rlsup cannot ``waitpid`` it.
It can hold a *pidfd* for it (``pidfd_open`` works on any process rlsup may signal): the descriptor
becomes readable when the rank exits, so :meth:`RankDeathWatch.wait` wakes at once, instead of after
the launcher's monitor interval, its own teardown of the other ranks and its exit. The rank's exit
status is then read from ``/proc/<pid>/stat`` (field 52, ``exit_code``, kept while the rank is a
zombie that its launcher has not reaped yet). A rank that exits 0 is finishing normally and is
ignored; any other status ends the attempt. When the launcher reaped the rank first, the status is
gone and nothing is claimed: the launcher's own report still classifies the attempt, only later.

Ranks are known by the pids in their heartbeat records (a rank that dies before its first heartbeat
is seen through the launcher, as before).
"""

from __future__ import annotations

import os
import select
import signal
from dataclasses import dataclass
from typing import Iterable

#: What a launcher sends the ranks left when one failed (torchrun's and ft_launcher's teardown): a rank
#: ended by one of these is the failure's consequence far more often than its cause.
TEARDOWN_SIGNALS = frozenset({"SIGTERM", "SIGINT", "SIGHUP"})
#: 0-based index of ``exit_code`` among the fields after the command name in /proc/<pid>/stat.
_EXIT_CODE_FIELD = 49  # field 52 of proc(5); fields 1-2 (pid, comm) are split off first


@dataclass(frozen=True)
class RankDeath:
    """A rank that ended with a non-zero status while its attempt ran."""

    rank: int
    pid: int
    exit_code: int | None  # set when it exited with a code
    signal: str | None  # set when a signal killed it

    def describe(self) -> str:
        how = f"signal {self.signal}" if self.signal else f"exit code {self.exit_code}"
        return f"rank {self.rank} (pid {self.pid}) died: {how}"


def zombie_status(pid: int) -> int | None:
    """The wait status of ``pid`` if it is a zombie (exited, not reaped yet); None otherwise."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rfind(b")") + 2:].split()  # the command name may contain spaces and ')'
    if not rest or rest[0] != b"Z" or len(rest) <= _EXIT_CODE_FIELD:
        return None
    try:
        return int(rest[_EXIT_CODE_FIELD])
    except ValueError:
        return None


def death_from_status(rank: int, pid: int, status: int) -> RankDeath | None:
    """A :class:`RankDeath` for a non-zero wait status; None for a clean exit."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return RankDeath(rank, pid, None, name)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else status
    return RankDeath(rank, pid, code, None) if code != 0 else None


def cause_first(death: RankDeath) -> tuple[int, int]:
    """Among ranks found dead together, the likely cause first: a signal other than a launcher's teardown
    (SIGKILL, SIGSEGV, SIGABRT ...), then a non-zero exit (a peer failing its collective), then a teardown
    signal; the lowest rank among equals."""
    if death.signal is None:
        return 1, death.rank
    return (2 if death.signal in TEARDOWN_SIGNALS else 0), death.rank


class RankDeathWatch:
    """pidfds for an attempt's ranks; :meth:`wait` is the run loop's sleep, cut short by a rank's death."""

    def __init__(self) -> None:
        self._fds: dict[int, tuple[int, int]] = {}  # pidfd -> (rank, pid)
        self._seen: set[int] = set()  # pids tracked once (a pid is never tracked again)
        # a rank gone before rlsup read its status (its launcher reaped it): the cause may be that one, in this
        # wait or a later one (a peer failing its collective exits 1 after it), so only a cause-like death is named
        self._reaped_unread = False

    def track(self, ranks: Iterable[tuple[int, int]]) -> None:
        """Start watching each (rank, pid) not seen before (skips pids that are already gone)."""
        for rank, pid in ranks:
            if pid <= 0 or pid in self._seen:
                continue
            self._seen.add(pid)
            try:
                fd = os.pidfd_open(pid)
            except (OSError, AttributeError):
                continue
            self._fds[fd] = (rank, pid)

    def wait(self, timeout: float) -> RankDeath | None:
        """Sleep up to ``timeout``; the first rank found dead with a non-zero status, else None."""
        if not self._fds:
            select.select([], [], [], timeout)
            return None
        readable, _, _ = select.select(list(self._fds), [], [], timeout)
        if not readable:
            return None
        # Every rank that is gone by now, not only the first fd: when one rank is SIGKILLed its peers
        # fail their collective and exit 1 a moment later, or its launcher SIGTERMs them (cause_first).
        readable, _, _ = select.select(list(self._fds), [], [], 0)
        deaths = []
        for fd in readable:
            rank, pid = self._fds.pop(fd)
            status = zombie_status(pid)
            os.close(fd)
            self._reaped_unread = self._reaped_unread or status is None
            death = death_from_status(rank, pid, status) if status is not None else None
            if death is not None:
                deaths.append(death)
        if self._reaped_unread and all(cause_first(d)[0] > 0 for d in deaths):
            # The cause may be the rank its launcher already reaped (its status is gone): a peer's exit 1 or
            # a teardown signal is a consequence, so the launcher's report says who failed.
            return None
        return min(deaths, key=cause_first) if deaths else None

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
