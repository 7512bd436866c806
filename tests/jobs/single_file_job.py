"""A trainer of the single-file kind (nanoGPT's shape): ``torch.save`` of everything over ``OUT/ckpt.pt``
every ``--save-every`` iterations, in place; ``--init_from=resume`` loads it (from ``--resume_path`` when
given, else ``OUT/ckpt.pt``). Prints nanoGPT-style ``iter N: loss X`` lines and ``resumed from iter N``.

usage: single_file_job.py OUT --iters N --save-every K [--init_from=scratch|resume] [--resume_path=P]

Test hook (environment): SFJ_KILL_IN_SAVE="ATTEMPT:SAVE" -- in attempt ATTEMPT (RLSUP_RESTART_COUNT), the
SAVE-th save of the attempt (1-based) SIGKILLs the process after writing half its bytes, through
``torch.save`` itself, so the file is torn exactly as a kill mid-save leaves it. Before that save the job
waits until rlsup has kept the previous save aside (``.rlsup-versions`` holds a version as new as it),
so the test's outcome does not depend on how loaded the machine is.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
import time
from pathlib import Path

import torch


class _KillHalfway(io.RawIOBase):
    """A file object that dies after ``limit`` bytes: the process is SIGKILLed inside torch.save."""

    def __init__(self, f: io.BufferedWriter, limit: int) -> None:
        self.f, self.left = f, limit

    def writable(self) -> bool:
        return True

    def write(self, b: bytes) -> int:  # type: ignore[override]
        if len(b) >= self.left:
            self.f.write(bytes(b)[: self.left])
            self.f.flush()
            os.fsync(self.f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        self.left -= len(b)
        return self.f.write(b)


def _wait_kept(out: Path, newer_than_ns: int) -> None:
    store = out / ".rlsup-versions"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if store.is_dir() and any(int(p.name.split("--")[0]) >= newer_than_ns for p in store.iterdir()
                                  if p.name[:1].isdigit()):
            return
        time.sleep(0.02)
    print("single_file_job: rlsup kept no version of the last save", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--init_from", default="scratch")
    p.add_argument("--resume_path", default="")
    p.add_argument("--step-time", type=float, default=0.05)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = args.out / "ckpt.pt"
    attempt = os.environ.get("RLSUP_RESTART_COUNT", "0")
    kill = dict(item.split(":") for item in os.environ.get("SFJ_KILL_IN_SAVE", "").split(",") if item)
    w, it = torch.zeros(256, 256), 0
    if args.init_from == "resume":
        state = torch.load(args.resume_path or ckpt, weights_only=True)
        w, it = state["w"], state["iter_num"]
        print(f"resumed from iter {it} ({args.resume_path or ckpt})", flush=True)
    # one write: under -u print writes the text and its newline apart, and the launcher's own line to the same merged
    # output (torchrun's, or the warm launcher's "started from warm ranks") can land between them (seen in CI)
    sys.stdout.write(f"argv: {sys.argv[1:]}\n")
    sys.stdout.flush()
    saves = 0
    while it < args.iters:
        it += 1
        w = w + it
        print(f"iter {it}: loss {1.0 / it:.4f}, time {args.step_time * 1000:.0f}ms, mfu -100.00%", flush=True)
        time.sleep(args.step_time)
        if it % args.save_every == 0:
            saves += 1
            data = {"w": w, "iter_num": it}
            if kill.get(attempt) == str(saves):
                _wait_kept(args.out, ckpt.stat().st_mtime_ns)
                with open(ckpt, "wb") as f:
                    torch.save(data, _KillHalfway(f, len(_bytes(data)) // 2))
            torch.save(data, ckpt)
    print(f"done at iter {it}", flush=True)
    return 0


def _bytes(data: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(data, buf)
    return buf.getvalue()


if __name__ == "__main__":
    sys.exit(main())
