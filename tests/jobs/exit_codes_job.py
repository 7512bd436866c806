"""Exits with the code given for its attempt: argv[1] is a comma list (last one repeats)."""
import os
import sys

codes = [int(c) for c in sys.argv[1].split(",")]
attempt = int(os.environ["RLSUP_RESTART_COUNT"])
print(f"attempt {attempt} restart_count={os.environ['RLSUP_RESTART_COUNT']} ckpt={os.environ['RLSUP_CHECKPOINT_DIR']}", flush=True)
sys.exit(codes[min(attempt, len(codes) - 1)])
