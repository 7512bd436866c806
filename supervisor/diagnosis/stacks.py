"""Collect every rank's Python stacks when an attempt hangs, before it is killed.

py-spy when installed (it also sees native frames and needs nothing from the rank); otherwise the
faulthandler that trainer_hooks registers on ``STACKS_SIGNAL``, which writes into a per-rank file
beside the heartbeat file. Only ranks that registered (they have a heartbeat record) are signalled,
since the signal's default action would kill a process that did not.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from rlsup_format.heartbeat_record import STACKS_SIGNAL, HeartbeatRecord, stacks_file_name
from rlsup_format.state_files import WARM_RANK_RECORD
from supervisor.diagnosis.step_reports import JOB_RANK, job_level_only


def dump_stacks(hb_dir: Path, records: Mapping[int, HeartbeatRecord], wait_s: float = 5.0) -> dict[str, str]:
    """``{"rank R pid P": stack text}`` for every rank with a heartbeat record."""
    stacks: dict[str, str] = {}
    pyspy = find_pyspy()
    pending: dict[str, Path] = {}
    records = dict(records)
    job = records.pop(JOB_RANK, None)  # the output's record: its pid never registered a stack handler
    if job is not None and job_level_only(records.values()):
        return job_tree_stacks(pyspy, job.pid, hb_dir)
    for rank, rec in sorted(records.items()):
        key = f"rank {rank} pid {rec.pid}"
        if pyspy and (text := _pyspy(pyspy, rec.pid)):
            stacks[key] = text
            continue
        try:
            os.kill(rec.pid, STACKS_SIGNAL)
            pending[key] = hb_dir / stacks_file_name(rank)
        except (ProcessLookupError, PermissionError):
            stacks[key] = "(process gone)"
    deadline = time.monotonic() + wait_s
    sizes: dict[str, int] = {}
    while pending and time.monotonic() < deadline:
        time.sleep(0.02)  # faulthandler writes from its C signal handler at once; a restart waits on this
        for key, path in list(pending.items()):
            size = path.stat().st_size if path.exists() else 0
            if size > 0 and sizes.get(key) == size:  # written and no longer growing
                stacks[key] = path.read_text(errors="replace")
                del pending[key]
            sizes[key] = size
    for key in pending:
        stacks[key] = "(no stack dump received)"
    return stacks


#: The first line of a stopped process's stacks: why it hangs, and how they were read.
STOPPED_NOTE = "(process stopped: SIGSTOP, or a debugger holds it; read with py-spy --nonblocking)"


def _pyspy(pyspy: str, pid: int) -> str | None:
    """py-spy's dump of ``pid``. A running process is paused for the read (a consistent stack); a
    stopped one (state T: SIGSTOP, or t: a debugger) cannot be, since py-spy's own stop and wait fail
    on it, so it is read without pausing: it is not running, so that read is consistent too. A process
    stopped while the blocking read ran is read again that way."""
    stopped = process_stopped(pid)
    text = _pyspy_run(pyspy, pid, nonblocking=stopped or in_filesystem_wait(pid))
    if text is None and not stopped and process_stopped(pid):
        stopped, text = True, _pyspy_run(pyspy, pid, nonblocking=True)
    return f"{STOPPED_NOTE}\n{text}" if text is not None and stopped else text


def _pyspy_run(pyspy: str, pid: int, nonblocking: bool) -> str | None:
    cmd = [pyspy, "dump", "--pid", str(pid), *(["--nonblocking"] if nonblocking else [])]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
    except (subprocess.TimeoutExpired, OSError):
        return None
    return out.stdout if out.returncode == 0 and out.stdout.strip() else None


#: Kernel waits a signal does not end: py-spy's pause would wait out its timeout (a rank writing to a hung
#: FUSE mount sleeps in request_wait_answer; NFS and Lustre waits show as state D).
FILESYSTEM_WAITS = ("request_wait_answer", "fuse_", "nfs", "rpc_wait", "ll_", "osc_", "cl_sync_io_wait")


def in_filesystem_wait(pid: int) -> bool:
    """Whether ``pid`` sleeps in state D or in a filesystem's wait (``/proc/PID/wchan``): read without pausing it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        with open(f"/proc/{pid}/wchan") as fh:
            wchan = fh.read().strip()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] == b"D" or wchan.startswith(FILESYSTEM_WAITS)


def process_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (state T) or by a tracer (t), from ``/proc/PID/stat``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] in (b"T", b"t")  # the name in (...) may hold spaces


def find_pyspy() -> str | None:
    """py-spy on PATH, or installed beside this interpreter (a venv whose bin is not on PATH)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


def job_tree_stacks(pyspy: str | None, root_pid: int, hb_dir: Path | None = None) -> dict[str, str]:
    """py-spy stacks of every Python process of a job that does not heartbeat itself (an unmodified
    trainer read through ``progress``), keyed by what each one is (:func:`tree_roles`): a rank as ``rank R pid
    P`` as far as any source tells its number, a launcher (the torchrun agent, a CLI that runs the trainer as
    its child) as ``launcher pid P (...)``, a trainer's own worker as ``pid P (helper of pid Q)``. A Ray
    driver's actors on this node are added (:func:`outside_ray_workers`). Dumps run side by side; a stopped
    process's text starts with :data:`STOPPED_NOTE` and one in a filesystem's wait with
    :data:`FILESYSTEM_NOTE` whether or not py-spy could read it (:func:`culprit` reads them)."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        tree = [root, *root.children(recursive=True)]
        outside = outside_ray_workers(tree, root.uids().real)
    except psutil.Error:
        return {f"job pid {root_pid}": "(process gone)"}
    keyed = [(role.pid, role.key()) for role in tree_roles(tree, hb_dir)]
    keyed += [(p.pid, f"pid {p.pid} ({title})") for p, title in outside]  # never a rank of this job
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        texts = list(pool.map(lambda k: _pyspy(pyspy, k[0]) if pyspy else None, keyed))
    out = {}
    for (pid, key), text in zip(keyed, texts):
        text = text or ("(no stack: py-spy is not installed)" if pyspy is None else "(py-spy could not read it)")
        out[key] = _with_state_note(pid, text)
    return out or {f"job pid {root_pid}": "(no Python process in the job)"}


#: The first line of the stacks of a process asleep in a filesystem's wait (state D, a FUSE/NFS/Lustre wchan).
FILESYSTEM_NOTE = "(process asleep in the kernel: state D or a filesystem's wait)"


def _with_state_note(pid: int, text: str) -> str:
    """``text`` led by why the process does not move, where its state says (py-spy's own read adds the
    stopped note already)."""
    if text.startswith((STOPPED_NOTE, FILESYSTEM_NOTE)):
        return text
    if process_stopped(pid):
        return f"{STOPPED_NOTE}\n{text}"
    if in_filesystem_wait(pid):
        return f"{FILESYSTEM_NOTE}\n{text}"
    return text


@dataclass(frozen=True)
class TreeRole:
    """One Python process of a job's tree: what it is, and its rank with where that number came from."""

    pid: int
    kind: str  # "trainer" | "launcher" | "helper"
    title: str  # the first words of its command line (or its Ray title)
    rank: int | None = None
    rank_from: str = ""  # "RANK", "LOCAL_RANK", "cmdline", "warm rank record", "the job's only process"
    parent: int | None = None

    def key(self) -> str:
        if self.kind == "launcher":
            return f"launcher pid {self.pid} ({self.title})"
        if self.kind == "helper":
            return f"pid {self.pid} (helper of pid {self.parent}: {self.title})"
        if self.rank is not None:
            return f"rank {self.rank} pid {self.pid}"
        return f"pid {self.pid} ({self.title})"


#: A trainer's own workers, never the trainer: multiprocessing's children (DataLoader workers spawned, the
#: resource tracker) and torch's compile workers. A forked worker is told by its command line, its parent's.
_HELPER_MARKS = ("from multiprocessing.", "--multiprocessing-fork", "_inductor/compile_worker", "_inductor.compile_worker")
#: Launchers by their command line (a launcher whose ranks have exited, or not started yet, has no Python child):
#: torchrun (and the warm launcher's zygote that becomes it), accelerate's and DeepSpeed's launchers.
_LAUNCHER_NAMES = ("torchrun", "warm_launcher.py", "accelerate", "deepspeed")
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch",
                     "deepspeed.launcher.runner")
_CMDLINE_RANK = re.compile(r"^--local[_-]rank(?:=(\d+))?$")


def tree_roles(tree: list, hb_dir: Path | None = None) -> list[TreeRole]:
    """What each Python process of the job's tree is (``tree``: psutil processes, the job's root first). A
    launcher is a Python process with a Python child that is not its helper (torchrun's agent, ``trl sft``
    running the trainer as a child): it never holds a rank, so a hang never names it while its trainer is
    known. A trainer's rank comes from its environment (``RANK``; ``LOCAL_RANK`` on one node), the warm rank's
    own record (a warm-started rank's ``/proc/PID/environ`` is the one it was spawned with: no ``RANK``), or
    its command line (``--local_rank N`` on one node); a job's only trainer, outside any distributed world
    (no ``WORLD_SIZE``, or 1), is rank 0."""
    import psutil

    info: dict[int, tuple[list[str], dict[str, str], int]] = {}
    for proc in tree:
        try:
            cmd, env, ppid = proc.cmdline(), proc.environ(), proc.ppid()
        except psutil.Error:
            continue
        if cmd and ("python" in os.path.basename(cmd[0]) or is_ray_worker(cmd[0])):
            info[proc.pid] = (cmd, env, ppid)  # py-spy reads Python processes (a Ray worker is one under its title)

    def helper(pid: int) -> bool:
        cmd, _, ppid = info[pid]
        return ppid in info and (cmd == info[ppid][0] or any(m in arg for arg in cmd for m in _HELPER_MARKS))

    # A warm rank with a record is a rank whatever its command line says (a forked one shows its zygote's, the
    # launcher's, until it writes the worker's over it).
    warm = warm_rank_records(hb_dir)
    helpers = {pid for pid in info if pid not in warm and helper(pid)}
    launchers = {info[pid][2] for pid in info if pid not in helpers and info[pid][2] in info}
    launchers |= {pid for pid in info if pid not in helpers and pid not in warm and _launcher_command(info[pid][0])}
    roles = []
    for pid, (cmd, env, ppid) in info.items():
        title = cmd[0].split()[0] if is_ray_worker(cmd[0]) else " ".join(cmd[:3])
        if pid in helpers:
            roles.append(TreeRole(pid, "helper", title, parent=ppid))
        elif pid in launchers:
            roles.append(TreeRole(pid, "launcher", title))
        else:
            rank, source = _rank_of(cmd, env, warm.get(pid))
            roles.append(TreeRole(pid, "trainer", title, rank, source))
    trainers = [r for r in roles if r.kind == "trainer"]
    if len(trainers) == 1 and trainers[0].rank is None and info[trainers[0].pid][1].get("WORLD_SIZE", "1") == "1":
        only = trainers[0]
        roles[roles.index(only)] = TreeRole(only.pid, only.kind, only.title, 0, "the job's only process")
    return roles


def _launcher_command(cmd: list[str]) -> bool:
    """Whether a command line is a known launcher's (the interpreter, then its script or ``-m`` module)."""
    head = cmd[1:4]
    return any(os.path.basename(a) in _LAUNCHER_NAMES or a in _LAUNCHER_MODULES for a in head)


def _one_node(env: Mapping[str, str]) -> bool:
    """Whether a local rank is the rank: the world is this node's (torchrun sets both sizes)."""
    return env.get("WORLD_SIZE") in (None, env.get("LOCAL_WORLD_SIZE"))


def _rank_of(cmd: list[str], env: Mapping[str, str], warm: int | None) -> tuple[int | None, str]:
    """A process's rank and where it came from, or (None, "")."""
    if env.get("RANK", "").isdigit():
        return int(env["RANK"]), "RANK"
    if warm is not None:
        return warm, "warm rank record"
    if env.get("LOCAL_RANK", "").isdigit() and _one_node(env):
        return int(env["LOCAL_RANK"]), "LOCAL_RANK"
    for i, arg in enumerate(cmd):
        m = _CMDLINE_RANK.match(arg)
        if m and _one_node(env):
            value = m.group(1) if m.group(1) is not None else (cmd[i + 1] if i + 1 < len(cmd) else "")
            if value.isdigit():
                return int(value), "cmdline"
    return None, ""


def warm_rank_records(hb_dir: Path | None) -> dict[int, int]:
    """{pid: rank} from the warm ranks' own records in the attempt's heartbeat directory
    (:data:`rlsup_format.state_files.WARM_RANK_RECORD`, written by ``supervisor/launch/warm_rank.py``)."""
    import json

    out: dict[int, int] = {}
    if hb_dir is None:
        return out
    try:
        paths = list(hb_dir.glob(WARM_RANK_RECORD.format(pid="*")))
    except OSError:
        return out
    for path in paths:
        try:
            data = json.loads(path.read_text())
            out[int(data["pid"])] = int(data["rank"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


@dataclass(frozen=True)
class Culprit:
    """The process a hang is blamed on, read from one incident's stacks: its pid, its rank where a source told
    it, and why it (stopped, in a filesystem's wait, the one rank the stacks single out, the job's only trainer)."""

    pid: int
    rank: int | None
    why: str
    singled_out: bool = True  # its state or the stacks set it apart (not merely the only trainer)

    def describe(self) -> str:
        who = f"rank {self.rank} (pid {self.pid})" if self.rank is not None else f"pid {self.pid}"
        return f"{who}: {self.why}"


_RANK_KEY = re.compile(r"^rank (\d+) pid (\d+)$")
_TRAINER_KEY = re.compile(r"^pid (\d+) \((?!helper of )")


def culprit(stacks: Mapping[str, str], suspects: list[int] | None = None) -> Culprit | None:
    """Who a job-level hang is blamed on, from :func:`job_tree_stacks`' keys and notes; never a launcher or a
    helper. First a trainer process that is stopped, then one asleep in a filesystem's wait, then the one rank
    the stacks' grouping singles out (``suspects``), then the job's only trainer process; None where several
    trainers are equally likely (nobody is named rather than the wrong one)."""
    trainers: list[tuple[int, int | None, str]] = []  # (pid, rank, text)
    for key, text in stacks.items():
        if m := _RANK_KEY.match(key):
            trainers.append((int(m.group(2)), int(m.group(1)), text))
        elif m := _TRAINER_KEY.match(key):
            trainers.append((int(m.group(1)), None, text))
    trainers.sort(key=lambda t: (t[1] is None, t[1] if t[1] is not None else 0, t[0]))
    for note, why in ((STOPPED_NOTE, "stopped (SIGSTOP, or a debugger holds it)"),
                      (FILESYSTEM_NOTE, "asleep in the kernel (state D or a filesystem's wait)")):
        held = [t for t in trainers if t[2].startswith(note)]
        if held:
            return Culprit(held[0][0], held[0][1], why)
    if suspects and len(suspects) == 1:
        named = [t for t in trainers if t[1] == suspects[0]]
        if len(named) == 1:
            return Culprit(named[0][0], named[0][1], "the one rank the stacks single out")
    if len(trainers) == 1:
        return Culprit(trainers[0][0], trainers[0][1], "the job's only trainer process", singled_out=False)
    return None


#: How Ray titles its worker processes: ``ray::<Actor>.<method>``, ``ray::<Actor>`` or ``ray::<task>``.
RAY_WORKER = "ray::"
#: Ray's own processes under that title: a pooled worker, the node's agents, object spilling.
RAY_NOT_A_JOB = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::SPILL_", "ray::RESTORE_",
                 "ray::DELETE_")


def is_ray_worker(title: str) -> bool:
    return title.startswith(RAY_WORKER) and not title.startswith(RAY_NOT_A_JOB)


def _maps_have(pid: int, needle: str) -> bool:
    """Whether a process has a library mapped (``/proc/PID/maps``: cheap, unlike smaps)."""
    try:
        with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as fh:
            return any(needle in line for line in fh)
    except OSError:
        return False


def outside_ray_workers(tree: list, uid: int) -> list:
    """(process, title) of this node's Ray workers that run a driver's actors outside the job's tree.

    Only where the tree holds a Ray driver (Ray's ``_raylet`` library loaded) but no raylet of its own:
    with ``ray start`` on the node, actors run under that cluster's raylet, not under the driver rlsup
    launched, and a hung actor is where the hang is (as ``ray stack`` lists them). A cluster the driver
    started itself (``ray.init()`` with no address) has its workers in the tree already. Only this
    user's processes. Neither start time nor environment ties a worker to its job (Ray reuses an idle
    worker for a later job; an actor's ``RAY_JOB_ID`` is the nil id), so workers of another Ray job of
    this user on this node are listed too, keyed by their titles, never as ranks of this job."""
    import psutil

    names = []
    for p in tree:
        try:
            names.append(p.name())
        except psutil.Error:
            continue
    if "raylet" in names or not any(_maps_have(p.pid, "_raylet") for p in tree):
        return []
    mine = {p.pid for p in tree}
    found = []
    for proc in psutil.process_iter(["cmdline", "uids"]):
        cmd = proc.info["cmdline"] or [""]
        uids = proc.info["uids"]
        if proc.pid not in mine and is_ray_worker(cmd[0]) and uids is not None and uids.real == uid:
            found.append((proc, cmd[0].split()[0]))
    return found
