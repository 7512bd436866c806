"""Compare CheckpointManager.save (staging, fsync, hashing, manifest, verify) with a bare torch.save.

Why: the protocol's cost (an fsync per file plus reading every byte back for xxh3-128) should be
small next to serialising the state; this prints both so a regression is visible.

    python benchmarks/bench_save.py --size-mb 100 --repeat 3 --backend torch
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from trainer_hooks.checkpoint import CheckpointManager
from rlsup_format.manifest import verify_step_dir


def make_state(size_mb: int) -> dict:
    n = size_mb * 1024 * 1024 // 4
    half = n // 2
    return {"model": {"w": torch.randn(half)}, "optim": {"m": torch.randn(n - half)}, "step": 0}


def timed(fn, repeat: int) -> list[float]:
    out = []
    for i in range(repeat):
        t = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--backend", default="torch", choices=["torch", "dcp", "megatron"])
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    state = make_state(args.size_mb)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)

        def plain(i: int) -> None:
            torch.save(state, root / f"plain_{i}.pt")

        def plain_fsync(i: int) -> None:
            path = root / f"plainfs_{i}.pt"
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

        mgr = CheckpointManager(root / "ckpt", backend=args.backend)

        def managed(i: int) -> None:
            mgr.save(i + 1, state)

        def verify(i: int) -> None:
            assert verify_step_dir(root / "ckpt" / f"step_{i + 1:09d}").valid

        rows = [("torch.save", timed(plain, args.repeat)),
                ("torch.save + fsync", timed(plain_fsync, args.repeat)),
                (f"CheckpointManager.save ({args.backend})", timed(managed, args.repeat)),
                ("verify_step_dir(full=True)", timed(verify, args.repeat))]
    base = statistics.median(rows[0][1])
    print(f"state: {args.size_mb} MB, repeat {args.repeat}, median seconds")
    print(f"{'operation':<36}{'median s':>10}{'MB/s':>10}{'vs torch.save':>15}")
    for name, times in rows:
        med = statistics.median(times)
        print(f"{name:<36}{med:>10.3f}{args.size_mb / med:>10.0f}{med / base:>14.2f}x")


if __name__ == "__main__":
    main()
