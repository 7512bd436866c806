"""Trains until rlsup asks it to stop (should_stop), then 'saves' a marker and exits 0."""
import sys
import time
from pathlib import Path

import trainer_hooks

marker = Path(sys.argv[1])
step = 0
while not trainer_hooks.should_stop():
    step += 1
    trainer_hooks.heartbeat(step)
    time.sleep(0.02)
marker.write_text(f"saved at step {step}")
print(f"stopping cleanly at step {step}", flush=True)
sys.exit(0)
