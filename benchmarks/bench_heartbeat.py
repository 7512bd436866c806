"""Cost of trainer_hooks.heartbeat(): per call, under rlsup (mmap record) and outside it (no-op).

Prints a table: name, median ns per call. The issue's budget is well under 50 us per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=200_000)
    args = p.parse_args()
    rows = [("heartbeat under rlsup (mmap)", measure(args.calls, True)),
            ("heartbeat outside rlsup (no-op)", measure(args.calls, False))]
    print(f"{'figure':40} {'ns/call':>10}")
    for name, ns in rows:
        print(f"{name:40} {ns:10.0f}")


if __name__ == "__main__":
    main()
