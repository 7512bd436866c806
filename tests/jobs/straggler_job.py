"""Four ranks (torchrun, gloo) all-reduce every step; rank 2 works 3x longer per step than the others.

argv: steps mode. mode "arrival": the heartbeat comes after the rank's own work and before the
all-reduce (rlsup reads arrival times); mode "work": the heartbeat comes after the all-reduce, and the
work is marked with trainer_hooks.section("work").
"""
import sys
import time

import torch
import torch.distributed as dist

import trainer_hooks

steps, mode = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
work_s = 0.12 if rank == 2 else 0.04


def forward_backward() -> torch.Tensor:
    time.sleep(work_s)
    return torch.ones(4)


for step in range(1, steps + 1):
    if mode == "work":
        with trainer_hooks.section("work"):
            grads = forward_backward()
        dist.all_reduce(grads)
        trainer_hooks.heartbeat(step)
    else:
        grads = forward_backward()
        trainer_hooks.heartbeat(step)
        dist.all_reduce(grads)
dist.destroy_process_group()
print(f"rank {rank} done at step {steps}", flush=True)
