"""What an rlsup run leaves on disk so its attempt can be ended without it: ``attempt_tree.json``.

rlsup writes it whenever the set of processes it supervises changes (a job root spawned, a new
descendant seen, an attempt ended); its guardian (:mod:`supervisor.processes.guardian`) and a successor
rlsup (``Supervisor.first_attempt``) read it when rlsup is gone. Every process is named by pid *and*
start time (``/proc/<pid>/stat`` field 22, clock ticks since boot, exact), so a reused pid is never
mistaken for one of ours. Standard library only: the guardian imports this and must start fast.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlsup_format.state_files import ATTEMPT_TREE


@dataclass(frozen=True)
class ProcRef:
    """One process, safe against pid reuse: it is ours only while ``start`` still matches."""

    pid: int
    start: int

    def matches(self) -> bool:
        return proc_start(self.pid) == self.start


@dataclass(frozen=True)
class RootRef:
    """A job root (an attempt's, or a warm launcher's): its own session (sid == pid) and cgroup, if any."""

    pid: int
    start: int
    cgroup: str | None = None


@dataclass
class TreeRecord:
    """Who owns the run (rlsup), its cgroup (None: no cgroup could be made), its live roots, every pid seen."""

    owner: ProcRef
    cgroup: str | None = None
    roots: list[RootRef] = field(default_factory=list)
    pids: list[ProcRef] = field(default_factory=list)
    boot: str = field(default_factory=lambda: boot_id())  # start times count from this boot only

    def owner_alive(self) -> bool:
        return self.owner.matches()

    def this_boot(self) -> bool:
        """Whether the record was written since the machine last booted (else every process it names
        died with that boot, and its pids and start times may be anyone's now)."""
        return self.boot == boot_id()


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def record_path(state_dir: Path) -> Path:
    return Path(state_dir) / ATTEMPT_TREE


def save(path: Path, record: TreeRecord) -> None:
    """Atomic replace (a reader never sees half a record); not fsynced: it matters while the node is up."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(record)))
    os.replace(tmp, path)


def load(path: Path) -> TreeRecord | None:
    try:
        raw = json.loads(Path(path).read_text())
        return TreeRecord(ProcRef(**raw["owner"]), raw.get("cgroup"), [RootRef(**r) for r in raw.get("roots", [])],
                          [ProcRef(**p) for p in raw.get("pids", [])], str(raw.get("boot", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name (field 3 onwards), or None when the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return raw[raw.rfind(")") + 2:].split()


def proc_start(pid: int) -> int | None:
    """Start time in clock ticks since boot; None when the pid is gone or a zombie (dead for us)."""
    fields = _stat_fields(pid)
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def proc_session(pid: int) -> tuple[int, int] | None:
    """(session id, start time) of a live pid; None when gone or a zombie."""
    fields = _stat_fields(pid)
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[3]), int(fields[19])


def all_pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []
