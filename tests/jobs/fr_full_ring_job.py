"""tests/jobs/fr_skip_job.py with full Flight Recorder rings: each step, before its gradient all-reduce, every rank
runs ``FR_JOB_BUSY`` (600) one-element all-reduces on the metrics group, so by the skipped collective (step 4)
each rank's ring (2000 entries, over 1 MB of JSON) has wrapped, and one node's two dumps are past etcd's
1.5 MB value limit unless cut. Rank ``FR_JOB_SKIPPER`` (default 2) skips step 4's gradient all-reduce on attempt
0; later attempts train to step 8 (gloo, CPU).
"""
import os
import time

import torch
import torch.distributed as dist

import trainer_hooks

dist.init_process_group("gloo")
rank = dist.get_rank()
metrics_group = dist.new_group(list(range(dist.get_world_size())), group_desc="metrics")
attempt = int(os.environ["RLSUP_RESTART_COUNT"])
skipper = int(os.environ.get("FR_JOB_SKIPPER", "2"))
busy = int(os.environ.get("FR_JOB_BUSY", "600"))


def sync(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    dist.all_reduce(tensor, group=group)


for step in range(1, 9):
    trainer_hooks.heartbeat(step)
    for _ in range(busy):
        dist.all_reduce(torch.ones(1), group=metrics_group)
    grads = torch.ones(4) * step
    if not (attempt == 0 and rank == skipper and step == 4):  # the bug: one rank skips one collective
        sync(grads)
    sync(torch.ones(1), metrics_group)
    time.sleep(0.05)
dist.destroy_process_group()
