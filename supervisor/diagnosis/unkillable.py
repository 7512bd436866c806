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
import platform
import re
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, TypeVar

from rlsup_format import state_files

UNINTERRUPTIBLE = "D"
_RANK_KEYS = (b"RANK", b"LOCAL_RANK")
_MEMORY_READ_DEADLINE_S = 0.5
_AT_FDCWD = -100
T = TypeVar("T")
# System calls a process can sleep in on a mount, by number: "fd" (the file behind its first argument) or the
# index of its path argument (1: relative to the directory fd in argument 0, an *at call).
_X86_64: dict[int, "int | str"] = {
    **dict.fromkeys((0, 1, 3, 5, 8, 17, 18, 19, 20, 40, 74, 75, 77, 217, 285, 295, 296, 326), "fd"),
    **dict.fromkeys((2, 4, 6, 21, 76, 82, 83, 84, 85, 86, 87, 89, 90, 92, 94, 132, 137), 0),
    **dict.fromkeys((257, 258, 259, 260, 262, 263, 264, 265, 267, 268, 269, 280, 316, 332, 437, 439), 1),
}
_ARM64: dict[int, "int | str"] = {
    **dict.fromkeys((46, 47, 57, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 80, 82, 83, 285), "fd"),
    **dict.fromkeys((43, 45, 49), 0),
    **dict.fromkeys((33, 34, 35, 37, 38, 48, 53, 54, 56, 78, 79, 88, 276, 291, 437, 439), 1),
}
_SYSCALLS = {"x86_64": _X86_64, "aarch64": _ARM64}
#: Filesystem types that hang when a server or daemon stops answering: their mounts are named first.
#: Kernel functions a caller sleeps in while a FUSE daemon or a network filesystem's server has not answered.
_REMOTE_WAIT = re.compile(r"fuse|request_wait_answer|nfs|rpc_wait|ptlrpc|lustre|cifs|smb|ceph|9p")
_SHARED_FS = ("fuse", "nfs", "lustre", "cifs", "smb", "ceph", "gpfs", "9p", "beegfs", "glusterfs", "afs")
#: The kernel's own filesystems: a call on them never waits for a server, so a file open there (e.g. a cgroup file
#: rlsup was reading in another thread as it forked a call) never names a mount that holds a process.
_KERNEL_FS = ("cgroup", "cgroup2", "proc", "sysfs", "devpts", "devtmpfs", "debugfs", "tracefs", "bpf", "securityfs",
              "pstore", "mqueue", "configfs", "fusectl", "hugetlbfs")


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
    waiting_on: str = ""  # the file its system call names (waiting_on), when it sleeps in one this knows
    paths: list[str] = field(default_factory=list)  # files it holds open (fds resolved), not pipes or sockets
    mounts: list[Mount] = field(default_factory=list)  # the non-root mounts those files lie on
    start_time: int | None = None  # /proc/<pid>/stat's starttime: tells this process from a later one of its pid

    @property
    def uninterruptible(self) -> bool:
        return self.state == UNINTERRUPTIBLE

    def describe(self) -> str:
        who = f"rank {self.rank} " if self.rank is not None else ""
        waits = f" in {self.wchan}" if self.wchan and self.wchan != "0" else ""
        waits += f" on {self.waiting_on}" if self.waiting_on else ""
        there = [p for p in self.paths if any(p.startswith(m.point.rstrip("/") + "/") for m in self.mounts)]
        files = f" holding {', '.join(there[:4])}" + (" …" if len(there) > 4 else "") if there else ""
        on = f" on {', '.join(m.describe() for m in self.mounts)}" if self.mounts else ""
        return f"{who}pid {self.pid} ({self.name}) state {self.state}{waits}{files}{on}"

    def as_dict(self) -> dict:
        return {"pid": self.pid, "state": self.state, "name": self.name, "wchan": self.wchan, "rank": self.rank,
                "waiting_on": self.waiting_on, "paths": self.paths, "mounts": [m.point for m in self.mounts],
                "start_time": self.start_time}


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
        point = unescape_octal(fields[4])  # mountinfo escapes space, tab, newline and backslash as \NNN
        found.append(Mount(point, tail[0], tail[1]))
    return sorted(found, key=lambda m: len(m.point), reverse=True)


def unescape_octal(text: str) -> str:
    """mountinfo's ``\\NNN`` escapes undone; every other character (UTF-8 names included) kept as it is."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def mount_of(path: str, table: list[Mount]) -> Mount | None:
    """The mount ``path`` lies on, by its text alone (never a stat)."""
    for m in table:
        if path == m.point or path.startswith(m.point.rstrip("/") + "/"):
            return m
    return None


def _may_hold(mount: Mount) -> bool:
    """Whether a file open on ``mount`` can be what holds a process: not the root's, nor the kernel's own."""
    return mount.point != "/" and mount.fstype not in _KERNEL_FS


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


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc/<pid>/stat's field 22); None when gone. A pid is reused
    once its process is gone: only the pid and this together name one process."""
    rest = _read(f"/proc/{pid}/stat").rpartition(")")[2].split()
    try:
        return int(rest[19])  # rest[0] is field 3 (the state)
    except (IndexError, ValueError):
        return None


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


def _bounded(read: Callable[[], T], default: T) -> T:
    """``read()`` in a daemon thread given :data:`_MEMORY_READ_DEADLINE_S`: reads of another process's memory
    wait on its memory lock, which a page fault into a hung mount holds; such a thread is abandoned."""
    box: list[T] = []

    def run() -> None:
        try:
            box.append(read())
        except (OSError, ValueError):
            pass

    thread = threading.Thread(target=run, daemon=True, name="rlsup-proc-read")
    thread.start()
    thread.join(_MEMORY_READ_DEADLINE_S)
    return box[0] if box else default


def with_warm_ranks(stuck: list[StuckProcess], hb_dir: Path) -> list[StuckProcess]:
    """``stuck`` with the rank of each warm-started one its environment does not give (it was spawned or forked
    before it became a rank: its number is in its own record in the attempt's heartbeat directory)."""
    from supervisor.diagnosis.stacks import warm_rank_records

    if all(p.rank is not None for p in stuck):
        return stuck
    warm = warm_rank_records(hb_dir)
    return [replace(p, rank=warm[p.pid]) if p.rank is None and p.pid in warm else p for p in stuck]


def _rank(pid: int) -> int | None:
    """RANK (or LOCAL_RANK) from the process's environment."""
    def read() -> int | None:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        return next((int(env[k]) for k in _RANK_KEYS if k in env), None)

    return _bounded(read, None)


def _string_at(pid: int, address: int) -> str | None:
    """The NUL-terminated string at ``address`` in ``pid``'s memory."""
    def read() -> str | None:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
            f.seek(address)
            raw = f.read(4096)
        end = raw.find(b"\0")
        return raw[:end].decode(errors="replace") if end > 0 else None

    return _bounded(read, None)


def waiting_on(pid: int) -> str:
    """The file the system call ``pid`` sleeps in names (``/proc/<pid>/syscall``: the path argument of an
    open, mkdir, stat, rename ... read from its memory, or the file behind the fd of a read, write or fsync);
    "" when it is in none this knows (or on another architecture than x86-64 and arm64)."""
    fields = _read(f"/proc/{pid}/syscall").split()
    table = _SYSCALLS.get(platform.machine())
    if table is None or len(fields) < 4 or not fields[0].isdigit():
        return ""
    kind = table.get(int(fields[0]))
    args = [int(a, 16) for a in fields[1:7]]
    dirfd = args[0] - (1 << 64) if args[0] >= 1 << 63 else args[0]
    if kind == "fd":
        return _fd_target(pid, dirfd)
    if kind is None:
        return ""
    path = _string_at(pid, args[kind])
    if not path or path.startswith("/"):
        return path or ""
    base = _fd_target(pid, dirfd) if kind == 1 and dirfd != _AT_FDCWD else _fd_target(pid, "cwd")
    return os.path.join(base, path) if base else path


def _fd_target(pid: int, fd: "int | str") -> str:
    try:
        return os.readlink(f"/proc/{pid}/{fd}" if fd == "cwd" else f"/proc/{pid}/fd/{fd}")
    except OSError:
        return ""


def examine(pids: list[int], table: list[Mount] | None = None) -> list[StuckProcess]:
    """What each of ``pids`` still alive is and waits on (a gone pid is left out)."""
    table = mounts() if table is None else table
    out = []
    for pid in pids:
        state, name = _state(pid)
        if not state or state in ("Z", "X"):
            continue
        target = waiting_on(pid)
        files = _open_files(pid)
        held = {path: mount_of(path, table) for path in ([target] if target else []) + files}
        suspects = [m for m in held.values() if m is not None and (m.fstype.startswith(_SHARED_FS) or
                                                                   (target and m == held[target]))]
        on = list(dict.fromkeys(suspects)) or list(dict.fromkeys(
            m for m in held.values() if m is not None and _may_hold(m)))
        files.sort(key=lambda path: (held[path] not in on, path))  # those on the suspect mounts first
        out.append(StuckProcess(pid, state, name, _read(f"/proc/{pid}/wchan").strip(), _rank(pid), target,
                                [p for p in files if p != target], on, start_time(pid)))
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


def record_stuck(attempt: int, stuck: list[StuckProcess], grace: float, say: Callable[[str], None],
                 record: Path | None = None) -> None:
    """Name what outlived the attempt's SIGKILL: the processes in state D (also written as JSON to ``record``)
    and those alive but not in D (only logged). Whether the attempt ends ``unkillable`` is the classifier's
    word (:func:`supervisor.diagnosis.outcome.unkillable_outcome`)."""
    if stuck and not uninterruptible(stuck):
        say(f"attempt {attempt}: still alive after SIGKILL (not in state D): " + "; ".join(p.describe() for p in stuck))
    held = uninterruptible(stuck)
    if held:
        say(f"attempt {attempt}: {verdict(stuck, grace)}; a failed attempt ends unkillable (no next attempt on this "
            "node beside them); a success, stop or preemption stands")
        _write_record(record, grace, held, say)


def _write_record(record: Path | None, grace: float, held: list[StuckProcess], say: Callable[[str], None]) -> None:
    if record is not None:
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps({"grace_s": grace, "processes": [p.as_dict() for p in held]}, indent=1))
        except OSError as e:
            say(f"could not write {record}: {e}")


def _thread_names() -> dict[int, str]:
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def held_threads(table: list[Mount] | None = None) -> list[dict]:
    """This process's own threads asleep in a system call on a file of a shared mount (FUSE, NFS, Lustre ...),
    or in state D: ``tid``, ``name`` (the Python thread's), ``state``, ``wchan``, ``waiting_on``, ``mount``.
    Such a thread holds the process's exit in the kernel until its mount answers: rlsup moves whatever touches
    the job's directories into forked children (:mod:`supervisor.bounded_calls`), and names any left here."""
    table = mounts() if table is None else table
    names, me = _thread_names(), threading.get_native_id()
    out = []
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []
    for tid in tids:
        if tid == me:
            continue
        state, _name = _state(tid)
        target = waiting_on(tid)
        mount = mount_of(target, table) if target else None
        on_shared = mount is not None and mount.fstype.startswith(_SHARED_FS)
        wchan = _read(f"/proc/{tid}/wchan").strip()
        if on_shared or (state == UNINTERRUPTIBLE and _REMOTE_WAIT.search(wchan)):  # a local disk's D passes
            out.append({"tid": tid, "name": names.get(tid, "?"), "state": state, "wchan": wchan,
                        "waiting_on": target, "mount": mount.point if mount is not None else ""})
    return out


def left_at_exit(state_dir: Path, code: int, helpers: list[dict], say: Callable[[str], None]) -> dict | None:
    """What rlsup leaves behind as it exits with ``code``: the attempt's processes found unkillable that are
    still alive (``unkillable.json``: the same process, by pid and start time; a record of an earlier run's, or
    one without a start time, names no process whose pid was reused since), its own forked calls still there
    (``helpers``: ``pid``, ``label``, ``doing``, ``state``), and its own threads asleep on a mount
    (:func:`held_threads`). Said in one line that names the mounts and each one's state (a helper merely busy is
    not said to be stuck), and written into ``unkillable.json`` under ``exit``; None when nothing is left."""
    record_path = state_dir / state_files.UNKILLABLE
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        record = {}
    table = mounts()
    ranks = [p for p in record.get("processes", []) if p.get("start_time") is not None
             and _state(p["pid"])[0] not in ("", "Z", "X") and start_time(p["pid"]) == p["start_time"]]
    for h in helpers:
        h["mounts"] = sorted({m.point for path in _open_files(h["pid"]) + [waiting_on(h["pid"])]
                              if path and (m := mount_of(path, table)) is not None and _may_hold(m)})
    threads = held_threads(table)
    if not (ranks or helpers or threads):
        return None
    named = sorted({m for p in ranks for m in p.get("mounts", [])} | {m for h in helpers for m in h["mounts"]}
                   | {t["mount"] for t in threads if t["mount"]})
    states = [_state(p["pid"])[0] for p in ranks] + [h["state"] for h in helpers] + [t["state"] for t in threads]
    parts = [f"rank {p['rank']} pid {p['pid']} ({_state_words(_state(p['pid'])[0])})" for p in ranks]
    parts += [f"rlsup's helper pid {h['pid']} ({h['label']}{': ' + h['doing'] if h['doing'] else ''}, "
              f"{_state_words(h['state'])})" for h in helpers]
    parts += [f"rlsup's own thread {t['name']} (tid {t['tid']}, {t['wchan'] or t['state']}"
              f"{' on ' + t['waiting_on'] if t['waiting_on'] else ''}): this process's exit waits for its mount"
              for t in threads]
    where = f" on mount{'s' if len(named) != 1 else ''} {', '.join(named)}" if named else ""
    held = " (not answering)" if where and UNINTERRUPTIBLE in states else ""
    say(f"exit {code}: left behind{where}{held}: {'; '.join(parts)}; the scheduler's node cleanup ends them once "
        "they are done, the mount answers or the node is rebooted")
    record["exit"] = {"code": code, "mounts": named, "ranks": [p["pid"] for p in ranks], "helpers": helpers,
                      "threads": threads}
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp = record_path.with_name(f".{record_path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, record_path)
    except OSError as e:
        say(f"could not write {record_path}: {e}")
    return record["exit"]


def _state_words(state: str) -> str:
    """A process's /proc state letter as the exit line says it: what it is doing, not a guess that it is stuck."""
    if state == UNINTERRUPTIBLE:
        return "state D: waiting in the kernel, on its mount"
    if state in ("R", "S"):
        return f"state {state}: busy, not held by the kernel"
    return f"state {state or '?'}"


__all__ = ["left_at_exit", "start_time", "held_threads", "record_stuck", "Mount", "StuckProcess", "mounts", "mount_of", "examine", "uninterruptible", "verdict", "UNINTERRUPTIBLE"]
