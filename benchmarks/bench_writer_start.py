"""The first saves of an attempt: the async writer started with the manager vs on the first save.

    python benchmarks/bench_writer_start.py [--size-mb 256] [--repeat 4] [--step-s 0.5]

Each trial is a fresh rank process (benchmarks/jobs/restart_saves.py) that builds
``CheckpointManager(async_save=True)``, restores ``--size-mb`` of state with ``torch.load``, and runs three
steps of ``--step-s`` (GPU compute stood in by a sleep), each followed by an async save into a memory tier
set up as ``rlsup run`` does. ``prestart`` is the manager as shipped (its writer process starts when it is
built, so the writer's interpreter and ``import torch`` overlap the restore and the first step); ``lazy``
stops that writer at once, so the first save starts one, as before. Sides alternate, a fresh process and
fresh directories per trial. Medians per side: each save's blocked time, the first step's time from its save
call until valid in memory, and the time from the manager's construction to the third save's return.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
CHILD = BENCH / "jobs" / "restart_saves.py"
SIDES = ("prestart", "lazy")


def trial(side: str, state_file: Path, step_s: float, shm: str | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="rlsup-bench-mem-", dir=shm) as mem, \
            tempfile.TemporaryDirectory(prefix="rlsup-bench-disk-") as disk:
        env = {**os.environ, "RLSUP_CHECKPOINT_DIR": disk, "RLSUP_MEMORY_DIR": mem, "RLSUP_MEMORY_KEEP_LAST": "1"}
        out = subprocess.run([sys.executable, str(CHILD), "--state", str(state_file), "--side", side,
                              "--step-s", str(step_s)], env=env, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"{side} trial failed ({out.returncode}): {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def run(size_mb: int = 256, repeat: int = 4, step_s: float = 0.5) -> dict[str, dict[str, float]]:
    """Per side, the medians over ``repeat`` trials (see the module docstring)."""
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="rlsup-bench-state-") as tmp:
        state_file = Path(tmp) / "state.pt"
        n = size_mb * 2**18
        torch.save({"model": {"w": torch.randn(n // 2)}, "optim": {"m": torch.randn(n - n // 2)}, "step": 0},
                   state_file)
        for i in range(repeat):
            for side in SIDES if i % 2 == 0 else tuple(reversed(SIDES)):
                results[side].append(trial(side, state_file, step_s, shm))
    med = statistics.median
    return {side: {"blocked_1": med(r["blocked"][0] for r in rs), "blocked_2": med(r["blocked"][1] for r in rs),
                   "blocked_3": med(r["blocked"][2] for r in rs), "valid_1": med(r["valid"][0] for r in rs),
                   "third_save_returned": med(r["last_returned"] for r in rs),
                   "restored": med(r["restored"] for r in rs)}
            for side, rs in results.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=0.5)
    args = ap.parse_args()
    print(f"load {os.getloadavg()[0]:.1f}", flush=True)
    for side, figs in run(args.size_mb, args.repeat, args.step_s).items():
        print(side, {k: round(v, 3) for k, v in figs.items()})
    print(f"load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
