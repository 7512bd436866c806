"""Collect every rank's Python stacks when an attempt hangs, before it is killed.

py-spy when installed (it also sees native frames and needs nothing from the rank); otherwise the
faulthandler that trainer_hooks registers on ``STACKS_SIGNAL``, which writes into a per-rank file
beside the heartbeat file. Only ranks that registered (they have a heartbeat record) are signalled,
since the signal's default action would kill a process that did not.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping

from rlsup_format.heartbeat_record import STACKS_SIGNAL, HeartbeatRecord, stacks_file_name
from supervisor.progress import JOB_RANK, job_level_only


def dump_stacks(hb_dir: Path, records: Mapping[int, HeartbeatRecord], wait_s: float = 5.0) -> dict[str, str]:
    """``{"rank R pid P": stack text}`` for every rank with a heartbeat record."""
    stacks: dict[str, str] = {}
    pyspy = find_pyspy()
    pending: dict[str, Path] = {}
    records = dict(records)
    job = records.pop(JOB_RANK, None)  # the output's record: its pid never registered a stack handler
    if job is not None and job_level_only(records.values()):
        return job_tree_stacks(pyspy, job.pid)
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


def job_tree_stacks(pyspy: str | None, root_pid: int) -> dict[str, str]:
    """py-spy stacks of every Python process of a job that does not heartbeat itself (an unmodified
    trainer read through ``progress``): keyed by its ``RANK`` when its environment has one. A Ray
    driver's actors on this node are added (:func:`outside_ray_workers`). Dumps run side by side."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        tree = [root, *root.children(recursive=True)]
        outside = outside_ray_workers(tree, root.uids().real)
    except psutil.Error:
        return {f"job pid {root_pid}": "(process gone)"}
    keyed = [k for k in map(_key_in_tree, tree) if k is not None]
    keyed += [(p.pid, f"pid {p.pid} ({title})") for p, title in outside]  # never a rank of this job
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        texts = list(pool.map(lambda k: _pyspy(pyspy, k[0]) if pyspy else None, keyed))
    out = {key: text or ("(no stack: py-spy is not installed)" if pyspy is None else "(py-spy could not read it)")
           for (_, key), text in zip(keyed, texts)}
    return out or {f"job pid {root_pid}": "(no Python process in the job)"}


def _key_in_tree(proc) -> tuple[int, str] | None:
    """(pid, key) of a Python process of the job's own tree; None for anything py-spy cannot read."""
    import psutil

    try:
        cmd = proc.cmdline()
        rank = proc.environ().get("RANK")
    except psutil.Error:
        return None
    if not cmd or not ("python" in os.path.basename(cmd[0]) or is_ray_worker(cmd[0])):
        return None  # py-spy reads Python processes (a Ray worker is one under its own title)
    if rank is not None:
        return proc.pid, f"rank {rank} pid {proc.pid}"
    if is_ray_worker(cmd[0]):
        return proc.pid, f"pid {proc.pid} ({cmd[0].split()[0]})"
    return proc.pid, f"pid {proc.pid} ({' '.join(cmd[:3])})"


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
