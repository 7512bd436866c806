"""Start, watch and stop a benchmark job under rlsup, torchrun or ft_launcher: shared by benchmarks/run.py and
benchmarks/bench_recovery.py, so every figure launches each side the same way; and what every bench_*.py harness
does around its trials (sides alternated, rows printed from a scratch directory removed at the end).

Jobs run in their own session with a scrubbed environment (no RLSUP_/TORCHELASTIC_/FT_ variables leak in);
trainers append ``time.monotonic()`` JSON events that :func:`events` reads back.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PY = sys.executable
BIN = Path(sys.executable).parent
TRAINER = BENCH / "jobs" / "bench_trainer.py"
T = TypeVar("T")


@dataclass(frozen=True)
class Figure:
    """One row of a harness's table (the fields of benchmarks/run.py's Row): rlsup's figure against its baseline."""

    name: str
    rlsup: float | None
    base: float | None
    unit: str
    note: str = ""

    def line(self) -> str:
        """The row as a harness prints it: name | rlsup | baseline | ratio | unit | note."""
        ratio = f"{self.rlsup / self.base:.2f}" if self.rlsup is not None and self.base else "n/a"
        return f"{self.name} | {self.rlsup} | {self.base} | {ratio} | {self.unit} | {self.note}"


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def job_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLSUP_", "TORCHELASTIC_", "FT_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env["RLSUP_METRICS_PORT"] = "0"
    env["OMP_NUM_THREADS"] = "1"
    return env


def nvrx_missing() -> str | None:
    """Why NVRx's ft_launcher cannot be benchmarked, or None when it can."""
    if importlib.util.find_spec("nvidia_resiliency_ext") is None:
        return "nvidia_resiliency_ext not importable (install: docs/nvrx.md)"
    if not (BIN / "ft_launcher").exists() and shutil.which("ft_launcher") is None:
        return "ft_launcher not on PATH"
    return None


def ft_launcher() -> str:
    return str(BIN / "ft_launcher") if (BIN / "ft_launcher").exists() else shutil.which("ft_launcher") or "ft_launcher"


def launch(kind: str, d: Path, trainer_args: list[str], max_restarts: int, extra: list[str] = (),
           trainer: Path = TRAINER) -> subprocess.Popen:
    """Start a 2-rank job of ``trainer`` in ``d`` under ``kind`` (rlsup | torchrun | ft), in its own session."""
    targs = [str(trainer), "--events", str(d / "events.jsonl"), "--checkpoint-dir", str(d / "ckpt"), *trainer_args]
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    if kind == "rlsup":
        cmd = [PY, "-m", "supervisor.cli.main", "run", "--state-dir", str(d / "state"), "--checkpoint-dir",
               str(d / "ckpt"), "--max-restarts", str(max_restarts), "--stop-grace", "2", "--kill-grace", "2",
               *extra, "--", *torchrun, *targs]
    elif kind == "torchrun":
        cmd = [*torchrun, "--max-restarts", str(max_restarts), *extra, *targs]
    elif kind == "ft":
        cmd = [ft_launcher(), "--standalone", "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
               "--ft-enable-nic-monitor", "false", *extra, *targs]
    else:
        raise ValueError(kind)
    out = open(d / "output.log", "wb")
    try:
        return subprocess.Popen(cmd, cwd=d, env=job_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        out.close()


def stop(proc: subprocess.Popen, grace: float = 8.0) -> None:
    """SIGTERM the job's process group (rlsup forwards to its own job session), SIGKILL after ``grace``;
    then SIGKILL whatever of its tree is left (torchrun's workers live in sessions of their own, and a
    baseline torchrun killed mid-restart left them running, loading every later measurement)."""
    import psutil

    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.kill()


def events(d: Path) -> list[dict]:
    path = d / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def failed(d: Path, what: str) -> None:
    """Say why a trial failed: the last lines of its output (the scratch directory is removed at the end)."""
    try:
        lines = (d / "output.log").read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    tail = [line for line in lines if "[rlsup]" in line or "rror" in line][-12:]
    log(f"{what}; last output lines:\n#   " + "\n#   ".join(tail))


def wait_until(pred: Callable[[], object], timeout: float, interval: float = 0.05) -> object:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval)


def alternate(reps: int, kinds: list[str]) -> Iterator[tuple[int, str]]:
    for r in range(reps):
        for k in (kinds if r % 2 == 0 else list(reversed(kinds))):
            yield r, k


def alternating_trials(reps: int, sides: Sequence[str], trial: Callable[[str], T],
                       say: Callable[[T], str] | None = None) -> dict[str, list[T]]:
    """Every side's ``trial`` ``reps`` times in :func:`alternate`'s order (a machine that drifts weighs on every side
    alike), each result logged as ``say`` puts it; the results by side."""
    res: dict[str, list[T]] = {side: [] for side in sides}
    for _, side in alternate(reps, list(sides)):
        t = trial(side)
        if say is not None:
            log(say(t))
        res[side].append(t)
    return res


def print_figures(prefix: str, scratch: str | None, run: Callable[[Path], Iterable[Figure]]) -> int:
    """A harness's command line once its arguments are read: ``run`` in a fresh scratch directory (under
    ``scratch``, a temp dir when None), each row printed as soon as it comes, the directory removed however
    ``run`` ends; the exit status."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=scratch))
    try:
        for f in run(work):
            print(f.line(), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False
