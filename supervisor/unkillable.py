"""Processes that outlive SIGKILL: what each one waits on, and the mount that holds it.

A rank writing to an NFS, Lustre or FUSE mount that stopped answering sleeps in the kernel in state D
(uninterruptible): SIGKILL is queued but never acted on until the mount answers. Launching the next attempt
beside it would put two trainers on one GPU and one checkpoint directory, and waiting for it may take
forever. So once an attempt's tree was SIGKILLed and ``kill_grace`` has passed, what is still alive is
examined here: its state (``/proc/<pid>/stat``), the kernel function it sleeps in (``/proc/<pid>/wchan``),
the files it holds (``/proc/<pid>/fd``) and the mounts those lie on (``/proc/self/mountinfo``, matched by
path: a ``stat`` of a hung mount would hang the caller too). A process in state D makes the run end with
exit 77 and this node in ``unhealthy_nodes`` (:data:`supervisor.lifecycle.EXCLUDES_NODE`).

Nothing here touches the stuck files themselves; the one read that can block (``/proc/<pid>/environ``,
for the rank, waits on the process's memory lock) runs in a daemon thread with a deadline.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from supervisor.attempt_end import AttemptResult

UNINTERRUPTIBLE = "D"
_RANK_KEYS = (b"RANK", b"LOCAL_RANK")
_ENVIRON_DEADLINE_S = 0.5


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo: where it is mounted, its filesystem type and source."""

    point: str
    fstype: str
    source: str

    def describe(self) -> str:
        return f"{self.point} ({self.fstype} {self.source})"


@dataclass
class StuckProcess:
    """A process alive after SIGKILL and its grace: why it cannot die."""

    pid: int
    state: str  # /proc/<pid>/stat's state letter: D is uninterruptible sleep
    name: str = ""
    wchan: str = ""
    rank: int | None = None
    paths: list[str] = field(default_factory=list)  # files it holds open (fds resolved), not pipes or sockets
    mounts: list[Mount] = field(default_factory=list)  # the non-root mounts those files lie on

    @property
    def uninterruptible(self) -> bool:
        return self.state == UNINTERRUPTIBLE

    def describe(self) -> str:
        who = f"rank {self.rank} " if self.rank is not None else ""
        waits = f" in {self.wchan}" if self.wchan and self.wchan != "0" else ""
        files = f" holding {', '.join(self.paths[:4])}" + (" …" if len(self.paths) > 4 else "") if self.paths else ""
        on = f" on {', '.join(m.describe() for m in self.mounts)}" if self.mounts else ""
        return f"{who}pid {self.pid} ({self.name}) state {self.state}{waits}{files}{on}"

    def as_dict(self) -> dict:
        return {"pid": self.pid, "state": self.state, "name": self.name, "wchan": self.wchan, "rank": self.rank,
                "paths": self.paths, "mounts": [m.point for m in self.mounts]}


def mounts(mountinfo: str = "/proc/self/mountinfo") -> list[Mount]:
    """The mount table, longest mount point first (the first prefix match of a path is its mount)."""
    found = []
    try:
        text = Path(mountinfo).read_text()
    except OSError:
        return []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        point = fields[4].encode().decode("unicode_escape")  # mountinfo escapes spaces as \040
        found.append(Mount(point, tail[0], tail[1]))
    return sorted(found, key=lambda m: len(m.point), reverse=True)


def mount_of(path: str, table: list[Mount]) -> Mount | None:
    """The mount ``path`` lies on, by its text alone (never a stat)."""
    for m in table:
        if path == m.point or path.startswith(m.point.rstrip("/") + "/"):
            return m
    return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _state(pid: int) -> tuple[str, str]:
    """(state letter, command name) from /proc/<pid>/stat; ("", "") when gone."""
    text = _read(f"/proc/{pid}/stat")
    if ")" not in text:
        return "", ""
    name = text[text.find("(") + 1:text.rfind(")")]
    rest = text[text.rfind(")") + 1:].split()
    return (rest[0] if rest else ""), name


def _open_files(pid: int) -> list[str]:
    """The regular files and directories ``pid`` holds (readlink never touches the file itself)."""
    base = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(base)
    except OSError:
        return []
    paths = []
    for fd in fds:
        try:
            target = os.readlink(f"{base}/{fd}")
        except OSError:
            continue
        if target.startswith("/") and not target.startswith("/dev/"):
            paths.append(target)
    cwd = ""
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        pass
    return sorted(set(paths)) + ([cwd] if cwd and cwd not in paths else [])


def _rank(pid: int) -> int | None:
    """RANK (or LOCAL_RANK) from the process's environment, read in a thread that may be abandoned: the read
    waits on the process's memory lock, which a page fault into a hung mount holds."""
    box: list[int | None] = []

    def read() -> None:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            box.append(next((int(env[k]) for k in _RANK_KEYS if k in env), None))
        except (OSError, ValueError):
            box.append(None)

    thread = threading.Thread(target=read, daemon=True, name=f"rlsup-environ-{pid}")
    thread.start()
    thread.join(_ENVIRON_DEADLINE_S)
    return box[0] if box else None


def examine(pids: list[int], table: list[Mount] | None = None) -> list[StuckProcess]:
    """What each of ``pids`` still alive is and waits on (a gone pid is left out)."""
    table = mounts() if table is None else table
    out = []
    for pid in pids:
        state, name = _state(pid)
        if not state or state in ("Z", "X"):
            continue
        on: list[Mount] = []
        placed = []
        for path in _open_files(pid):
            m = mount_of(path, table)
            if m is not None and m.point != "/" and m not in on:
                on.append(m)
            placed.append((m is None or m.point == "/", path))
        files = [path for _, path in sorted(placed)]  # the files on mounts first: those are what it waits on
        out.append(StuckProcess(pid, state, name, _read(f"/proc/{pid}/wchan").strip(), _rank(pid), files, on))
    return out


def uninterruptible(stuck: list[StuckProcess]) -> list[StuckProcess]:
    return [p for p in stuck if p.uninterruptible]


def verdict(stuck: list[StuckProcess], grace: float) -> str:
    """One line for the incident: which processes survived SIGKILL, and the mounts that hold them."""
    held = uninterruptible(stuck)
    mounts_named = sorted({m.point for p in held for m in p.mounts})
    where = f"; mount{'s' if len(mounts_named) > 1 else ''} {', '.join(mounts_named)} not answering" \
        if mounts_named else ""
    return (f"{len(held)} process{'es' if len(held) != 1 else ''} unkillable (state D {grace:g}s after SIGKILL): "
            + "; ".join(p.describe() for p in held) + where)


def unkillable_result(result: "AttemptResult", stuck: list[StuckProcess], grace: float,
                      say: Callable[[str], None], record: Path | None = None) -> bool:
    """An attempt whose processes outlived SIGKILL in state D ends ``unkillable`` (the node is excluded: exit
    77), its original ending kept in the detail, the stuck processes named (and written as JSON to
    ``record``); True when it did. Processes alive but not in D are only logged."""
    from supervisor.lifecycle import EndReason

    if stuck and not uninterruptible(stuck):
        say(f"attempt {result.attempt}: still alive after SIGKILL (not in state D): "
            + "; ".join(p.describe() for p in stuck))
    held = uninterruptible(stuck)
    if not held:
        return False
    line = verdict(stuck, grace)
    say(f"attempt {result.attempt}: {line}; no next attempt on this node beside them")
    before = f"{result.reason}: {result.detail}" if result.detail else str(result.reason)
    result.reason, result.detail = EndReason.UNKILLABLE, f"{line} (the attempt had ended: {before})"
    result.suspect_ranks = sorted({*result.suspect_ranks, *(p.rank for p in held if p.rank is not None)})
    if result.rank is None:
        result.rank, result.pid = held[0].rank, held[0].pid
    if record is not None:
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps({"grace_s": grace, "processes": [p.as_dict() for p in held]}, indent=1))
        except OSError as e:
            say(f"could not write {record}: {e}")
    return True


__all__ = ["unkillable_result", "Mount", "StuckProcess", "mounts", "mount_of", "examine", "uninterruptible", "verdict", "UNINTERRUPTIBLE"]
