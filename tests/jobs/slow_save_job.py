"""Heartbeats, then spends argv[1] seconds inside a save section (no heartbeats), then finishes."""
import os
import sys
import time

import trainer_hooks

save_s = float(sys.argv[1])
for step in range(1, 4):
    trainer_hooks.heartbeat(step)
    time.sleep(0.05)
if os.environ["RLSUP_RESTART_COUNT"] == "0":
    with trainer_hooks.section("save"):
        time.sleep(save_s)  # a slow save: no heartbeats meanwhile
for step in range(4, 8):
    trainer_hooks.heartbeat(step)
    time.sleep(0.05)
