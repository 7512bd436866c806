"""Cost of trainer_hooks.heartbeat(): per call, under rlsup (mmap record) and outside it (no-op).

Prints a table: name, median ns per call. The issue's budget is well under 50 us per call. Then the
slowdown of a tight training loop (small matmuls) with a heartbeat per step; the budget is <= 1%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import os, sys, time
import trainer_hooks
n = int(sys.argv[1])
trainer_hooks.heartbeat(0)
runs = []
for _ in range(7):
    t0 = time.perf_counter_ns()
    for i in range(n):
        trainer_hooks.heartbeat(i)
    runs.append((time.perf_counter_ns() - t0) / n)
runs.sort()
print(runs[len(runs) // 2])
"""


def measure(n: int, under_rlsup: bool) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSUP_")}
    with tempfile.TemporaryDirectory() as d:
        if under_rlsup:
            env["RLSUP_HEARTBEAT_DIR"] = d
        out = subprocess.run([sys.executable, "-c", CHILD, str(n)], env=env, capture_output=True, text=True,
                             check=True)
    return float(out.stdout.strip())


STEP_CHILD = r"""
import json, sys, time
import torch
import trainer_hooks
torch.set_num_threads(1)
steps, blocks = int(sys.argv[1]), int(sys.argv[2])
a, b = torch.randn(128, 128), torch.randn(128, 128)

def block(hb):
    t0 = time.perf_counter_ns()
    for i in range(steps):
        for _ in range(4):
            torch.mm(a, b)
        if hb:
            trainer_hooks.heartbeat(i)
    return (time.perf_counter_ns() - t0) / steps / 1e3

block(True); block(False)  # warm-up
out = {"with": [], "without": []}
for k in range(blocks):  # alternate, and swap the order every block
    for hb in ((True, False) if k % 2 == 0 else (False, True)):
        out["with" if hb else "without"].append(block(hb))
print(json.dumps(out))
"""


def step_overhead(steps_per_block: int = 1000, blocks: int = 15) -> tuple[float, float]:
    """Median microseconds per training step (4 x 128x128 matmul, one thread) with and without
    ``heartbeat(step)`` after each step, under rlsup (a heartbeat directory set); blocks alternate."""
    import json

    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSUP_")}
    with tempfile.TemporaryDirectory() as d:
        env["RLSUP_HEARTBEAT_DIR"] = d
        out = subprocess.run([sys.executable, "-c", STEP_CHILD, str(steps_per_block), str(blocks)], env=env,
                             capture_output=True, text=True, check=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return statistics.median(data["with"]), statistics.median(data["without"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=200_000)
    p.add_argument("--step-blocks", type=int, default=15, help="blocks of 1000 training steps per side")
    args = p.parse_args()
    rows = [("heartbeat under rlsup (mmap)", measure(args.calls, True)),
            ("heartbeat outside rlsup (no-op)", measure(args.calls, False))]
    print(f"{'figure':40} {'ns/call':>10}")
    for name, ns in rows:
        print(f"{name:40} {ns:10.0f}")
    with_hb, without = step_overhead(blocks=args.step_blocks)
    print(f"\ntraining step (4 x 128x128 matmul): {with_hb:.1f} us with heartbeat, {without:.1f} us without "
          f"({100 * (with_hb / without - 1):+.2f}%)")


if __name__ == "__main__":
    main()
