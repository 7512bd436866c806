"""A trainer of PyKEEN's shape (issue 41), without PyKEEN's weight: one checkpoint file, rewritten in place
after every epoch, that it resumes from by itself as it starts; its only progress line is the one it prints
at each save, in PyKEEN's words (``=> Saved checkpoint after having finished epoch N.``). The file is a pickle
(rlsup checks a pickle's opcodes as it checks a ``torch.save`` zip), so an attempt starts in milliseconds.

usage: pykeen_shape_job.py CKPT --epochs N [--epoch-time S]

Faults (environment; attempts counted by RLSUP_RESTART_COUNT), each a real SIGKILL of this process:
  PKS_KILL_AFTER_FIRST_SAVE=K  attempts 0..K-1 die right after their first save's line is out.
  PKS_DIE_IN_EPOCH=E           every attempt dies in epoch E, before saving it (a real crash loop).
  PKS_TEAR_FIRST_SAVE=1        attempt 0 dies halfway through writing its first save (torn, never complete).
"""

from __future__ import annotations

import argparse
import os
import pickle
import signal
import sys
import time
from pathlib import Path


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt", type=Path)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--epoch-time", type=float, default=0.05)
    args = p.parse_args()
    attempt = int(os.environ.get("RLSUP_RESTART_COUNT", "0"))
    kill_after_first = attempt < int(os.environ.get("PKS_KILL_AFTER_FIRST_SAVE", "0"))
    die_in = int(os.environ.get("PKS_DIE_IN_EPOCH", "0"))
    tear = attempt == 0 and os.environ.get("PKS_TEAR_FIRST_SAVE") == "1"
    args.ckpt.parent.mkdir(parents=True, exist_ok=True)
    epoch, weights = 0, [0.0] * 20_000
    if args.ckpt.exists():
        state = pickle.loads(args.ckpt.read_bytes())  # a torn file raises here, as torch.load does in PyKEEN
        epoch, weights = state["epoch"], state["weights"]
        print(f"=> loaded checkpoint '{args.ckpt}' stopped after having finished epoch {epoch}", flush=True)
    else:
        print(f"=> no checkpoint found at '{args.ckpt}'. Creating a new file.", flush=True)
    while epoch < args.epochs:
        time.sleep(args.epoch_time)
        if epoch + 1 == die_in:
            _die()
        epoch += 1
        weights = [w + epoch for w in weights]
        data = pickle.dumps({"epoch": epoch, "weights": weights})
        with open(args.ckpt, "wb") as f:  # truncated, then rewritten: torch.save over the same path
            if tear:
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
                _die()
            f.write(data)
        print(f"=> Saved checkpoint after having finished epoch {epoch}.", flush=True)
        if kill_after_first:
            _die()
    print(f"training done at epoch {epoch}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
