"""The trainer that benchmarks/run.py launches under rlsup, torchrun and ft_launcher (2 ranks, gloo, CPU).

Every rank appends JSON lines to ``--events`` (one ``os.write`` per line on an O_APPEND descriptor), each
with ``time.monotonic()``: CLOCK_MONOTONIC is system-wide on Linux, so times written by different
processes (ranks, attempts, the benchmark itself) are on the same clock.

    start     a rank process began (pid, attempt)
    rendezvous rank 0 finished init_process_group (the job's rendezvous and the collective's set-up)
    resumed   rank 0 restored its state: the step it resumes from
    step      rank 0 completed a step (step, dur = compute + all-reduce + sleep, saves excluded)
    save      rank 0 finished a checkpoint save (dur)
    kill      the fault rank is about to SIGKILL itself (--crash-at-step)
    hang      the fault rank stops heartbeating and sleeps forever (--hang-at-step)

The attempt number is ``RLSUP_RESTART_COUNT`` under rlsup (each attempt is a new launcher), else
``TORCHELASTIC_RESTART_COUNT`` (torchrun's and ft_launcher's own restarts). The trainer resumes by
itself from the newest valid checkpoint in ``--checkpoint-dir`` (trainer_hooks.CheckpointManager), so
the same script works with every launcher. Under ft_launcher it also reports to NVRx's rank monitor
(``RankMonitorClient.send_heartbeat`` per step), which NVRx's hang detection needs.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

import job_events
import trainer_hooks
from trainer_hooks import CheckpointManager


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", required=True)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--steps", type=int, default=10**9)
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--async-save", action="store_true", help="CheckpointManager(async_save=True)")
    p.add_argument("--crash-at-step", type=int, default=None)
    p.add_argument("--hang-at-step", type=int, default=None)
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-attempt", type=int, default=0)
    args = p.parse_args()

    job = job_events.start(args.events)
    rank, world, attempt, emit = job.rank, job.world, job.attempt, job.emit

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    ckpt = CheckpointManager(args.checkpoint_dir, keep_last=3, async_save=args.async_save)
    state = {"model": model, "optimizer": optimizer}
    step = ckpt.restore(state)
    if rank == 0:
        emit("resumed", step=step)

    while step < args.steps:
        t0 = time.monotonic()
        g = torch.Generator().manual_seed(step * 7 + rank)
        x = torch.randn(32, 64, generator=g)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        if world > 1:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
        optimizer.step()
        time.sleep(args.step_time)
        step += 1
        trainer_hooks.heartbeat(step)
        job.heartbeat()
        if rank == 0:
            emit("step", step=step, dur=time.monotonic() - t0)
        if step % args.checkpoint_every == 0:
            t1 = time.monotonic()
            ckpt.save(step, state)
            if rank == 0:
                emit("save", step=step, dur=time.monotonic() - t1)
        if attempt == args.fault_attempt and rank == args.fault_rank:
            if step == args.crash_at_step:
                emit("kill", step=step)
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.hang_at_step:
                emit("hang", step=step)
                while True:
                    time.sleep(1)
    ckpt.wait()
    job.finish(step)


if __name__ == "__main__":
    main()
