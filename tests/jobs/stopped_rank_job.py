"""Two modes, neither with trainer_hooks (rlsup reads their progress from the output, ``step N`` lines):

``stopped_rank_job.py ranks STOP_ATTEMPTS`` -- under torchrun (gloo): the ranks all-reduce every step, rank 0 prints
``step N``; in the attempts listed in STOP_ATTEMPTS (comma-separated RLSUP_RESTART_COUNT values) rank 1 prints
``rank 1 pid P stopping`` at step 4 and SIGSTOPs itself, so rank 0 waits in all_reduce and the output goes silent.
Other attempts train to step 8 and exit 0.

``stopped_rank_job.py child`` -- one process whose Python runs the trainer as its child (the shape of ``trl sft``
in one process): the parent prints ``launcher pid P`` and waits; the trainer prints ``trainer pid P`` and steps,
and in attempt 0 gets stuck at step 3 (a sleep that never ends). Later attempts train to step 6 and exit 0.
"""

import os
import signal
import subprocess
import sys
import time

attempt = int(os.environ.get("RLSUP_RESTART_COUNT", "0"))


def ranks(stop_attempts: set[int]) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(1, 9):
        if rank == 1 and step == 4 and attempt in stop_attempts:
            print(f"rank 1 pid {os.getpid()} stopping", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(torch.ones(4))
        if rank == 0:
            print(f"step {step}", flush=True)
        time.sleep(0.05)
    dist.destroy_process_group()


def stuck_here() -> None:
    while True:
        time.sleep(0.5)


def trainer() -> None:
    print(f"trainer pid {os.getpid()}", flush=True)
    for step in range(1, 7):
        if attempt == 0 and step == 3:
            stuck_here()
        print(f"step {step}", flush=True)
        time.sleep(0.05)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "ranks":
        ranks({int(a) for a in sys.argv[2].split(",")})
    elif mode == "child":
        print(f"launcher pid {os.getpid()}", flush=True)
        sys.exit(subprocess.run([sys.executable, __file__, "trainer"]).returncode)
    else:
        trainer()
