"""Reports two steps per attempt through trainer_hooks, then crashes (exit 3); at the attempt named by
TWO_STEPS_STOP_AT (RLSUP_RESTART_COUNT) it stops itself with SIGSTOP after its two steps instead: a hang no
handler in the rank sees. Later attempts exit 0. argv: the seconds each step takes."""
import os
import signal
import sys
import time

import trainer_hooks

step_s = float(sys.argv[1])
attempt = int(os.environ["RLSUP_RESTART_COUNT"])
stop_at = int(os.environ.get("TWO_STEPS_STOP_AT", "-1"))
for step in (1, 2):
    time.sleep(step_s)
    trainer_hooks.heartbeat(step)
if attempt == stop_at:
    print(f"attempt {attempt}: stopping myself after step 2", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
sys.exit(0 if attempt > stop_at else 3)
