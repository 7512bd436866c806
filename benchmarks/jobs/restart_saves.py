"""One rank's first saves after a restart, for benchmarks/bench_writer_start.py.

    python benchmarks/jobs/restart_saves.py --state F --side prestart|lazy --steps 3 --step-s 0.5

A fresh process (torch already imported, as in a warm rank) builds ``CheckpointManager(async_save=True)``,
restores the state from ``--state`` (a real ``torch.load``), then runs ``--steps`` steps of ``--step-s``
(a sleep: the compute of a GPU step, which leaves the host cores to the writer) each followed by an async
save into the memory tier named by ``RLSUP_MEMORY_DIR``. ``lazy`` stops the writer the manager started, so
the first save starts it, as every save did before the writer was started with the manager. Prints one JSON
line: the seconds each save blocked, each step's time from its save call until it verified in memory, and
the time from the manager's construction to the last save's return.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from rlsup_format.manifest import verify_step_dir
from rlsup_format.names import step_dir_name
from trainer_hooks.checkpoint import CheckpointManager


def watch_valid(directory: Path, steps: int, called: dict[int, float], valid: dict[int, float],
                done: threading.Event) -> None:
    """Record when each step's directory first verifies (sizes), polling every 2 ms."""
    while not done.is_set() and len(valid) < steps:
        for step in list(called):
            if step not in valid and verify_step_dir(directory / step_dir_name(step), full=False).valid:
                valid[step] = time.perf_counter() - called[step]
        time.sleep(0.002)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--state", required=True)
    ap.add_argument("--side", choices=("prestart", "lazy"), required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--step-s", type=float, default=0.5)
    args = ap.parse_args()
    memory = Path(os.environ["RLSUP_MEMORY_DIR"])
    t0 = time.perf_counter()
    mgr = CheckpointManager(keep_last=2, async_save=True)
    if args.side == "lazy":
        mgr._async.close()  # the first save starts a writer again: the way before
        t0 = time.perf_counter()  # the close waited for the writer it stopped: not this side's time
    state = torch.load(args.state, weights_only=True)
    restored = time.perf_counter() - t0
    called: dict[int, float] = {}
    valid: dict[int, float] = {}
    done = threading.Event()
    watcher = threading.Thread(target=watch_valid, args=(memory, args.steps, called, valid, done), daemon=True)
    watcher.start()
    blocked = []
    for step in range(1, args.steps + 1):
        time.sleep(args.step_s)
        state["model"]["w"].add_(1.0)
        called[step] = time.perf_counter()
        mgr.save(step, state)
        blocked.append(time.perf_counter() - called[step])
    last_returned = time.perf_counter() - t0
    mgr.wait()
    watcher.join(60)
    done.set()
    mgr.close()
    print(json.dumps({"side": args.side, "restored": restored, "blocked": blocked,
                      "valid": [valid.get(s) for s in range(1, args.steps + 1)], "last_returned": last_returned}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
