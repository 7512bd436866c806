"""Four ranks (torchrun, gloo) reduce gradients on the default group and a metric on a second group
each step. On attempt 0, rank 2 skips the gradient all-reduce of step 4 and goes on to the metric's:
ranks 0, 1 and 3 wait in the default group's all-reduce for it while rank 2 waits in the other
group's for them. Every rank's stack is in the same ``sync`` -> ``all_reduce``, so the grouped stacks
name nobody; the Flight Recorder names rank 2 and the collective. Later attempts train to step 8.

``FR_JOB_DEVICE=cuda``: NCCL on one GPU per rank (tests/gpu), each step waiting for its collectives
(NCCL's return at once); ``FR_JOB_SKIPPER``: the rank that skips (default 2).
"""
import os
import time

import torch
import torch.distributed as dist

import trainer_hooks

cuda = os.environ.get("FR_JOB_DEVICE") == "cuda"
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
metrics_group = dist.new_group(list(range(dist.get_world_size())), group_desc="metrics")
attempt = int(os.environ["RLSUP_RESTART_COUNT"])
skipper = int(os.environ.get("FR_JOB_SKIPPER", "2"))
device = torch.device("cuda") if cuda else torch.device("cpu")


def sync(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    dist.all_reduce(tensor, group=group)


for step in range(1, 9):
    trainer_hooks.heartbeat(step)
    grads = torch.ones(4, device=device) * step
    if not (attempt == 0 and rank == skipper and step == 4):  # the bug: one rank skips one collective
        sync(grads)
    sync(torch.ones(1, device=device), metrics_group)
    if cuda:
        torch.cuda.synchronize()
    time.sleep(0.05)
dist.destroy_process_group()
