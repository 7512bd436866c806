"""What watching a job costs: ``rlsup run``'s own CPU while a 2-rank torchrun job sleeps, against torchrun's agent's.

    .venv/bin/python benchmarks/bench_watch_cpu.py                       # 3 repetitions per side, 20 s windows
    .venv/bin/python benchmarks/bench_watch_cpu.py --rlsup-root /tmp/old # rlsup from another checkout (before/after)
    .venv/bin/python benchmarks/run.py --only watch_cpu                  # the same, as run.py's rows

Both sides watch the same job (``torchrun --standalone --nproc-per-node 2`` of a script that sleeps): rlsup polls
the job's processes, heartbeats and output every ``poll_interval`` (0.1 s); torchrun's agent polls its workers
every ``monitor_interval`` (0.1 s in torch 2.13). The figure is each watcher's *own* CPU (user + system of that one
process, not its children) over a window that starts once every import is done, as a share of one core. rlsup runs
with ``--warm-launcher false`` (the launcher is a process of its own, armed once per attempt) and no metrics port.
Sides alternate (rlsup first on even repetitions). The host's process count is printed: psutil's tree walk, which
rlsup used before, read every process on the host at each poll.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
SETTLE_S = 8.0  # launch -> every import done, on a loaded 2-core machine
SLEEPER = "import time\ntime.sleep(3600)\n"


@dataclass(frozen=True)
class WatchCpu:
    """One side's repetitions: the watcher's own CPU as a share of one core."""

    side: str
    shares: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.shares)


def torchrun_cmd(script: Path) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]


def own_cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def watcher_share(cmd: list[str], env: dict[str, str], cwd: Path, window_s: float) -> float:
    """Start ``cmd`` (the watcher), let it settle, and return its own CPU over ``window_s`` as a share of a core."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        time.sleep(SETTLE_S)  # a benchmark's fixed settle time, not a test's wait for an event
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited {proc.returncode} before the window")
        before, t0 = own_cpu(proc.pid), time.monotonic()
        time.sleep(window_s)
        return (own_cpu(proc.pid) - before) / (time.monotonic() - t0)
    finally:
        for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            try:
                p.kill()
            except psutil.Error:
                pass
        proc.wait()


def measure(reps: int = 3, window_s: float = 20.0, rlsup_root: Path = ROOT) -> list[WatchCpu]:
    """rlsup's and torchrun's own CPU, ``reps`` alternating repetitions each."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSUP_")}
    env["PYTHONPATH"] = str(rlsup_root)
    shares: dict[str, list[float]] = {"rlsup": [], "torchrun": []}
    with tempfile.TemporaryDirectory(prefix="rlsup-watch-cpu-") as tmp:
        script = Path(tmp) / "sleeper.py"
        script.write_text(SLEEPER)
        sides = {"rlsup": [PY, "-m", "supervisor.cli.main", "run", "--metrics-port", "0", "--warm-launcher", "false", "--",
                           *torchrun_cmd(script)],
                 "torchrun": torchrun_cmd(script)}
        for rep in range(reps):
            for side in (("rlsup", "torchrun") if rep % 2 == 0 else ("torchrun", "rlsup")):
                cwd = Path(tmp) / f"{side}{rep}"
                cwd.mkdir()
                shares[side].append(watcher_share(sides[side], env, cwd, window_s))
                print(f"  {side} rep {rep}: {100 * shares[side][-1]:.2f} % of a core "
                      f"({len(psutil.pids())} processes on the host)", flush=True)
    return [WatchCpu(side, tuple(v)) for side, v in shares.items()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--window", type=float, default=20.0, help="seconds of each measured window")
    ap.add_argument("--rlsup-root", type=Path, default=ROOT, help="the rlsup checkout to run (default: this one)")
    args = ap.parse_args()
    for w in measure(args.reps, args.window, args.rlsup_root):
        print(f"{w.side}: median {100 * w.median:.2f} % of a core ({', '.join(f'{100 * s:.2f}' for s in w.shares)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
