"""Heartbeats a few steps, then hangs on attempt 0 (a stuck 'collective'); later attempts finish."""
import os
import sys
import time

import trainer_hooks


def stuck_in_collective() -> None:
    while True:
        time.sleep(1)


attempt = int(os.environ["RLSUP_RESTART_COUNT"])
for step in range(1, 6):
    trainer_hooks.heartbeat(step)
    time.sleep(0.05)
if attempt == 0:
    print("hanging now", flush=True)
    stuck_in_collective()
sys.exit(0)
