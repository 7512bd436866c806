"""Collect every rank's Python stacks when an attempt hangs, before it is killed.

py-spy when installed (it also sees native frames and needs nothing from the rank); otherwise the
faulthandler that trainer_hooks registers on ``STACKS_SIGNAL``, which writes into a per-rank file
beside the heartbeat file. Only ranks that registered (they have a heartbeat record) are signalled,
since the signal's default action would kill a process that did not.
"""

from __future__ import annotations

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


def _pyspy(pyspy: str, pid: int) -> str | None:
    try:
        out = subprocess.run([pyspy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=15)
    except (subprocess.TimeoutExpired, OSError):
        return None
    return out.stdout if out.returncode == 0 and out.stdout.strip() else None


def find_pyspy() -> str | None:
    """py-spy on PATH, or installed beside this interpreter (a venv whose bin is not on PATH)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


def job_tree_stacks(pyspy: str | None, root_pid: int) -> dict[str, str]:
    """py-spy stacks of every Python process of a job that does not heartbeat itself (an unmodified
    trainer read through ``progress``): keyed by its ``RANK`` when its environment has one."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
        if any(map(_is_ray_driver, procs)):
            procs += node_ray_workers(skip={p.pid for p in procs})
    except psutil.Error:
        return {f"job pid {root_pid}": "(process gone)"}
    out: dict[str, str] = {}
    for proc in procs:
        try:
            cmd = proc.cmdline()
            env = proc.environ()
        except psutil.Error:
            continue
        if not cmd or not ("python" in os.path.basename(cmd[0]) or is_ray_worker(cmd[0])):
            continue  # py-spy reads Python processes (a Ray worker is one under its own title)
        if (rank := env.get("RANK")) is not None:
            key = f"rank {rank} pid {proc.pid}"
        elif is_ray_worker(cmd[0]):
            key = f"pid {proc.pid} ({cmd[0].split()[0]})"
        else:
            key = f"pid {proc.pid} ({' '.join(cmd[:3])})"
        text = _pyspy(pyspy, proc.pid) if pyspy else None
        out[key] = text or ("(no stack: py-spy is not installed)" if pyspy is None else "(py-spy could not read it)")
    return out or {f"job pid {root_pid}": "(no Python process in the job)"}


#: How Ray titles its worker processes: ``ray::<Actor>.<method>`` or ``ray::<task>`` while busy.
RAY_WORKER = "ray::"
#: Ray's own processes under that title: a pooled worker and the node's agents, nobody's job.
RAY_NOT_A_JOB = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")


def is_ray_worker(title: str) -> bool:
    return title.startswith(RAY_WORKER) and not title.startswith(RAY_NOT_A_JOB)


def _is_ray_driver(proc) -> bool:
    """Whether a process has Ray's core library loaded (a driver, or a worker of an embedded cluster)."""
    import psutil

    try:
        return any("_raylet" in m.path for m in proc.memory_maps())
    except (psutil.Error, OSError):
        return False


def node_ray_workers(skip: set[int]) -> list:
    """This node's busy Ray workers outside the job's process tree, as ``ray stack`` lists them. Where
    ``ray start`` runs the cluster, a driver's actors run under the raylet, not under the driver rlsup
    launched, and their stacks are where a hang is. Neither start time nor environment ties a worker
    to its job (Ray reuses idle workers for a later job, and an actor's ``RAY_JOB_ID`` is the nil
    id), so busy workers of other Ray jobs on this node are listed too, each keyed by its title."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or [""]
        if proc.pid not in skip and is_ray_worker(cmd[0]):
            found.append(proc)
    return found
