"""Heartbeats and saves tiny verified checkpoints; attempt 0 exits 3 after its first save, later
attempts resume and train until rlsup asks them to stop (should_stop), then exit 0.

argv: [save_every [crash]] (defaults 3, 1); crash 0: attempt 0 does not crash either.
Each save takes at least 0.3 s (inside a save section), so rlsup's polls see it.
Writes nothing but checkpoints (RLSUP_CHECKPOINT_DIR).
"""
import os
import sys
import time

import trainer_hooks
from trainer_hooks import CheckpointManager

save_every = int(sys.argv[1]) if len(sys.argv) > 1 else 3
crash = sys.argv[2] != "0" if len(sys.argv) > 2 else True
save_seconds = 0.3
attempt = int(os.environ["RLSUP_RESTART_COUNT"])
step = int(os.environ.get("RLSUP_RESUME_STEP", "0"))
ckpt = CheckpointManager(keep_last=3)
print(f"attempt {attempt} starting at step {step}", flush=True)
while not trainer_hooks.should_stop():
    step += 1
    trainer_hooks.heartbeat(step)
    time.sleep(0.05)
    if step % save_every == 0:
        with trainer_hooks.section("save"):  # a save long enough for rlsup's 0.1 s polls to see
            time.sleep(save_seconds)
            ckpt.save(step, {"step": step, "weights": list(range(64))})
        if attempt == 0 and crash:
            print(f"crashing after the save of step {step}", flush=True)
            sys.exit(3)
print(f"stopping at step {step}", flush=True)
