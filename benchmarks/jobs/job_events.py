"""What every benchmark trainer does first and last: its events file, the process group, NVRx's rank monitor; and
after each step: the ``step`` event, the save at its cadence timed as a ``save`` event.

Events are JSON lines appended to ``--events`` (one ``os.write`` per line on an O_APPEND descriptor), each
with ``time.monotonic()`` (system-wide on Linux: ranks, attempts and the benchmark share the clock), the
rank, the attempt (``RLSUP_RESTART_COUNT`` under rlsup, else torchrun's and ft_launcher's
``TORCHELASTIC_RESTART_COUNT``) and the pid. Imported by path's neighbours (the trainers in this folder).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist


@dataclass
class JobStart:
    """One rank's place in the job, its event writer and, under ft_launcher, NVRx's rank monitor client."""

    rank: int
    world: int
    attempt: int
    fd: int
    nvrx: Any = None

    def emit(self, ev: str, **kw: object) -> None:
        kw.update(ev=ev, t=time.monotonic(), rank=self.rank, attempt=self.attempt, pid=os.getpid())
        os.write(self.fd, (json.dumps(kw) + "\n").encode())

    def heartbeat(self) -> None:
        if self.nvrx is not None:
            self.nvrx.send_heartbeat()

    def stepped(self, step: int, t0: float, **kw: object) -> None:
        """Step ``step``, begun at ``t0`` (monotonic), is done: NVRx's heartbeat, then rank 0's ``step`` event (its
        ``dur`` taken now, before any save, so a save never counts as step time)."""
        self.heartbeat()
        if self.rank == 0:
            self.emit("step", step=step, dur=time.monotonic() - t0, **kw)

    def save_every(self, every: int, step: int, save: Callable[[], object]) -> None:
        """Every ``every``-th step (0: never) ``save()``, and rank 0's ``save`` event: how long the loop was
        blocked."""
        if every and step % every == 0:
            t1 = time.monotonic()
            save()
            if self.rank == 0:
                self.emit("save", step=step, dur=time.monotonic() - t1)

    def finish(self, step: int) -> None:
        """Leave the rank monitor and the process group, then say ``done``."""
        if self.nvrx is not None:
            self.nvrx.shutdown_workload_monitoring()
        if self.world > 1:
            dist.barrier()
            dist.destroy_process_group()
        self.emit("done", step=step)


def start(events: str) -> JobStart:
    """Open the events file, say ``start``, join the process group (``rendezvous``, rank 0) and, under
    ft_launcher (its IPC socket in the environment), start NVRx's workload monitoring."""
    job = JobStart(rank=int(os.environ.get("RANK", "0")), world=int(os.environ.get("WORLD_SIZE", "1")),
                   attempt=int(os.environ.get("RLSUP_RESTART_COUNT") or os.environ.get("TORCHELASTIC_RESTART_COUNT")
                               or 0),
                   fd=os.open(events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
    job.emit("start")
    torch.set_num_threads(1)
    if job.world > 1:
        dist.init_process_group("gloo")
    if job.rank == 0:
        job.emit("rendezvous")
    if os.environ.get("FT_RANK_MONITOR_IPC_SOCKET"):
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        job.nvrx = RankMonitorClient()
        job.nvrx.init_workload_monitoring()
    return job
