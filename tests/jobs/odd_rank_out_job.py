"""Four ranks (torchrun, gloo) all-reduce every step; on attempt 0 rank 3 gets stuck loading a batch
at step 4, so ranks 0-2 wait in all_reduce for it: the stacks must name rank 3 as the suspect.
Later attempts train to step 8 and exit 0.
"""
import os
import time

import torch
import torch.distributed as dist

import trainer_hooks

dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ["RLSUP_RESTART_COUNT"])


def load_batch(step: int) -> torch.Tensor:
    while attempt == 0 and rank == 3 and step == 4:  # a stuck read of the data
        time.sleep(0.5)
    return torch.ones(4) * step


for step in range(1, 9):
    batch = load_batch(step)
    trainer_hooks.heartbeat(step)  # the step's own work is done: arrive at the collective
    dist.all_reduce(batch)
    time.sleep(0.05)
dist.destroy_process_group()
