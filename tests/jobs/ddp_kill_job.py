"""2-rank gloo job: on attempt 0, rank 1 SIGKILLs itself at step 5; a later attempt completes."""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import trainer_hooks

dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ["RLSUP_RESTART_COUNT"])
out = sys.argv[1]
t = torch.zeros(1)
for step in range(1, 11):
    t += 1
    dist.all_reduce(t)
    trainer_hooks.heartbeat(step)
    if attempt == 0 and rank == 1 and step == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.02)
with open(f"{out}.rank{rank}.attempt{attempt}", "w") as f:
    f.write(str(float(t)))
dist.destroy_process_group()
