"""Realistic recovery (issue 31): goodput under SIGKILLs of a job whose step is 0.5 s of real compute and
whose state is 67 MB per rank, rlsup at its best against ft_launcher and torchrun at theirs.

    .venv/bin/python benchmarks/bench_recovery.py --minutes 5 --reps 1
    .venv/bin/python benchmarks/bench_recovery.py --sides rlsup/sync,ft --minutes 2.5 --reps 2
    .venv/bin/python benchmarks/run.py --only recovery          # the same, as run.py's table rows

Trainer: benchmarks/jobs/recovery_trainer.py, 2 ranks (torchrun, gloo, CPU). Before the trials a plain
torchrun calibration run picks ``--micro-batches`` so a step takes ~0.5 s here (the same number for every
side) and measures the reference step time and what a torch.save of the state blocks the loop.

Sides (each launched by benchmarks/jobctl.py, as every figure of run.py):

    rlsup            rlsup run --memory-dir /dev/shm/... --disk-every D; CheckpointManager(async_save=True)
                     saves every step (into RAM; rlsup drains every D-th step to disk in the background)
    rlsup/sync       the same, synchronous saves (the best here: the step's compute and an async
                     writer share the host CPU; BENCHMARKS.md "Realistic recovery")
    rlsup/sync-cold  rlsup/sync with --warm-launcher false
    rlsup/k          async saves every k steps, k = Young's cadence for a memory-tier save's cost
    ft               ft_launcher --max-restarts 1000; torch.save to disk every K steps
    torchrun         torchrun --max-restarts 1000; the same trainer and K

K is Young's first-order optimum, sqrt(2 x save cost x mean time between failures) / step time, from
the calibration's save cost: the cadence that maximises the baselines' goodput given what a save costs
them. Faults: SIGKILL of a uniformly chosen rank of the newest attempt, gaps uniform in 20-40 s, from a
fixed seed (every side gets the same schedule). Sides alternate (A/B/C, C/B/A, ...). Accounting:
benchmarks/recovery_accounting.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

from jobctl import (Figure, alternating_trials, events, launch, log, nvrx_missing, pid_alive,  # noqa: E402
                    print_figures, stop)
from recovery_accounting import Kill, Trial, account, kill_schedule, young_cadence  # noqa: E402

TRAINER = BENCH / "jobs" / "recovery_trainer.py"
TARGET_STEP_S = 0.5
GAP_S = (20.0, 40.0)
#: Where each trial's logs and events are kept (RLSUP_BENCH_KEEP), else nowhere.
KEEP = Path(os.environ["RLSUP_BENCH_KEEP"]) if os.environ.get("RLSUP_BENCH_KEEP") else None


@dataclass(frozen=True)
class Calibration:
    """What the plain calibration run measured (seconds)."""

    micro_batches: int
    step_s: float
    torch_save_s: float  # the loop blocked in a torch.save of the rank's state to disk
    memory_save_s: float  # the loop blocked in a synchronous CheckpointManager.save into rlsup's memory tier


@dataclass(frozen=True)
class Side:
    """One contender: its launcher, its trainer flags and its launcher flags."""

    name: str
    launcher: str
    trainer: tuple[str, ...]
    extra: tuple[str, ...] = ()
    label: str = ""  # rlsup's: how its trainer saves into the memory tier


def calibrate_run(work: Path, launcher: str, trainer: list[str], extra: list[str] = ()) -> list[dict]:
    """One short job with no fault: rank 0's events."""
    d = Path(tempfile.mkdtemp(prefix="calibrate-", dir=work))
    proc = launch(launcher, d, trainer, max_restarts=0, extra=list(extra), trainer=TRAINER)
    try:
        if proc.wait(300) != 0:
            raise RuntimeError(f"calibration run {launcher} {trainer} failed: exit {proc.returncode}")
    finally:
        stop(proc)
    evs = [e for e in events(d) if e["rank"] == 0]
    shutil.rmtree(d, ignore_errors=True)
    return evs


def calibrate(work: Path, micro_batches: int | None, shm: Path) -> Calibration:
    """Pick the micro-batches for a ~0.5 s step (unless given); measure the step, a torch.save, and a
    (synchronous) save into rlsup's memory tier."""
    def durs(evs: list[dict], ev: str) -> float:  # the first of each kind warms up
        xs = [e["dur"] for e in evs if e["ev"] == ev]
        return statistics.median(xs[1:] or xs)

    if micro_batches is None:
        one = calibrate_run(work, "torchrun", ["--micro-batches", "1", "--steps", "6", "--checkpoint-every", "0"])
        micro_batches = max(1, round(TARGET_STEP_S / durs(one, "step")))
    mb = ["--micro-batches", str(micro_batches), "--steps", "10", "--checkpoint-every", "2"]
    plain = calibrate_run(work, "torchrun", [*mb, "--saver", "torch"])
    memory = calibrate_run(work, "rlsup", [*mb, "--saver", "hooks"], ["--memory-dir", str(shm), "--disk-every", "100"])
    shutil.rmtree(shm, ignore_errors=True)
    return Calibration(micro_batches, durs(plain, "step"), durs(plain, "save"), durs(memory, "save"))


def sides(cal: Calibration, every: int, mem_every: int, disk_every: int, shm: Path) -> dict[str, Side]:
    """rlsup with the memory tier every step (async; sync; sync without warm ranks) and at its own Young
    cadence; the baselines at theirs. Keys are what ``--sides`` names."""
    mb = ("--micro-batches", str(cal.micro_batches))
    base = (*mb, "--saver", "torch", "--checkpoint-every", str(every))
    memory = ("--memory-dir", str(shm), "--disk-every", str(disk_every))
    hooks = (*mb, "--saver", "hooks", "--checkpoint-every")
    out = {"rlsup": Side("rlsup", "rlsup", (*hooks, "1", "--async-save"), memory, "every step, async"),
           "rlsup/sync": Side("rlsup-sync", "rlsup", (*hooks, "1"), memory, "every step, sync"),
           "rlsup/sync-cold": Side("rlsup-sync-cold", "rlsup", (*hooks, "1"), (*memory, "--warm-launcher", "false"),
                                   "every step, sync, no warm ranks"),
           "rlsup/k": Side(f"rlsup-every{mem_every}", "rlsup", (*hooks, str(mem_every), "--async-save"), memory,
                           f"every {mem_every} steps, async")}
    if nvrx_missing() is None:
        out["ft"] = Side("ft", "ft", base)
    out["torchrun"] = Side("torchrun", "torchrun", base)
    return out


def victim(d: Path, rank: int) -> tuple[int, int] | None:
    """(pid, attempt) of ``rank`` in the newest attempt, if that process is alive."""
    starts = [e for e in events(d) if e["ev"] == "start" and e["rank"] == rank]
    if not starts:
        return None
    e = max(starts, key=lambda e: (e["attempt"], e["t"]))
    return (e["pid"], e["attempt"]) if pid_alive(e["pid"]) else None


def trial(work: Path, side: Side, window: float, schedule: list[tuple[float, int]], ref_step: float) -> Trial:
    """One side under the kill schedule for ``window`` seconds."""
    d = Path(tempfile.mkdtemp(prefix=f"recovery-{side.name}-", dir=work))
    t0 = time.monotonic()
    proc = launch(side.launcher, d, list(side.trainer), max_restarts=1000, extra=list(side.extra), trainer=TRAINER)
    kills: list[Kill] = []
    pending = list(schedule)
    t_end = t0 + window
    while time.monotonic() < t_end:
        time.sleep(0.05)
        if pending and time.monotonic() >= t0 + pending[0][0]:
            v = victim(d, pending[0][1])
            if v is not None:  # else the newest attempt is not up yet: the kill waits for it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(v[0], signal.SIGKILL)
                    kills.append(Kill(time.monotonic(), pending[0][1], v[1]))
                pending.pop(0)
    evs = events(d)
    stop(proc)
    res = account(evs, kills, t0, t_end, ref_step)
    text = (d / "output.log").read_text(errors="replace")
    refused = text.count("connectFullMesh")
    log(f"recovery {side.name}: goodput {res.goodput:.3f}, {res.useful_steps} useful of {res.trained_steps} trained, "
        f"{res.kills} kills, redone/failure {res.redone_per_failure}, failed restarts "
        f"{sum(r.failed_restarts for r in res.recoveries)} (connectFullMesh in output: {refused}), "
        f"load {os.getloadavg()[0]:.2f}")
    for r in res.recoveries:
        log(f"  {r}")
    if KEEP is not None:  # the launcher's log, rlsup's incidents and the events, for a closer look
        dest = KEEP / d.name
        dest.mkdir(parents=True, exist_ok=True)
        for rel in ("output.log", "events.jsonl", "state/incidents.jsonl"):
            with contextlib.suppress(OSError):
                shutil.copy(d / rel, dest / rel.replace("/", "-"))
        (dest / "kills.txt").write_text("".join(f"{k.t} {k.rank} {k.attempt}\n" for k in kills))
        (dest / "window.txt").write_text(f"{t0} {t_end} {ref_step}\n")
    shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(side.extra[1] if side.extra[:1] == ("--memory-dir",) else "/nonexistent", ignore_errors=True)
    return res


def med(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def pooled_redone(ts: list[Trial]) -> float | None:
    xs = [r.redone for t in ts for r in t.recoveries if r.redone is not None]
    return sum(xs) / len(xs) if xs else None


def breakdown(ts: list[Trial]) -> str:
    """Median per failure over every trial of a side: where the time went."""
    rs = [r for t in ts for r in t.recoveries]
    parts = [("to rank start", [r.to_start for r in rs]), ("rendezvous", [r.rendezvous for r in rs]),
             ("restore", [r.restore for r in rs]), ("first step", [r.first_step for r in rs]),
             ("regained", [r.regained for r in rs])]
    failed = sum(r.failed_restarts for r in rs)
    never = len([r for r in rs if r.regained is None])
    txt = ", ".join(f"{n} {x:.2f}" for n, x in ((n, med(v)) for n, v in parts) if x is not None)
    return f"per failure (median s): {txt}; failed restarts {failed}; not recovered in window {never}"


def summary(name: str, ts: list[Trial], window: float) -> str:
    return (f"{name}: goodput {'/'.join(f'{t.goodput:.3f}' for t in ts)}, useful/trained steps "
            f"{'/'.join(f'{t.useful_steps}:{t.trained_steps}' for t in ts)}, kills {sum(t.kills for t in ts)} "
            f"({sum(t.kills_in_recovery for t in ts)} of an attempt still recovering), "
            f"saves blocked {med([t.save_blocked_s / window for t in ts]) or 0:.3f} of wall, step "
            f"{med([t.median_step_s for t in ts]) or 0:.3f} s; {breakdown(ts)}")


def figures(res: dict[str, list[Trial]], labels: dict[str, str], cal: Calibration, every: int, disk_every: int,
            window: float) -> list[Figure]:
    def good(name: str) -> float | None:
        return med([t.goodput for t in res.get(name, [])])

    head = (f"step {cal.step_s:.3f} s ({cal.micro_batches} micro-batches), 67 MB/rank, SIGKILL every "
            f"{GAP_S[0]:.0f}-{GAP_S[1]:.0f} s, {window / 60:.1f} min/side")
    ours = [k for k in res if k.startswith("rlsup")]
    rows = []
    for base, label in (("ft", "ft_launcher"), ("torchrun", "torchrun")):
        if base not in res:
            rows.append(Figure(f"realistic recovery goodput vs {label}", good("rlsup"), None, "frac",
                               f"n/a: {nvrx_missing() or 'side not run'}"))
            continue
        for mine in ours:
            cadence = labels[mine]
            rows.append(Figure(
                f"realistic recovery goodput ({head}): rlsup memory tier {cadence}, disk every {disk_every} "
                f"vs {label}, torch.save every {every}", good(mine), good(base), "frac",
                f"{summary(mine, res[mine], window)} | {summary(base, res[base], window)}"))
            rows.append(Figure(f"realistic recovery: steps redone per failure, rlsup memory tier {cadence} vs {label}",
                               pooled_redone(res[mine]), pooled_redone(res[base]), "steps",
                               f"save blocks: torch.save {cal.torch_save_s:.3f} s, memory tier (sync) "
                               f"{cal.memory_save_s:.3f} s"))
    return rows


def run(work: Path, minutes: float = 5.0, reps: int = 1, seed: int = 31, micro_batches: int | None = None,
        disk_every: int = 20, only: tuple[str, ...] = ()) -> list[Figure]:
    """Calibrate, then every side ``reps`` times for ``minutes``, alternating; the table's rows."""
    window = minutes * 60
    shm = (Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())) / f"rlsup-recovery-{os.getpid()}"
    cal = calibrate(work, micro_batches, shm)
    mtbf = sum(GAP_S) / 2
    every = young_cadence(cal.torch_save_s, mtbf, cal.step_s)
    mem_every = young_cadence(cal.memory_save_s, mtbf, cal.step_s)
    log(f"recovery: calibration {cal}; saves every {every} steps (torch.save), {mem_every} (memory tier) by Young, "
        f"MTBF {mtbf:.0f} s; load {os.getloadavg()}")
    all_sides = {k: v for k, v in sides(cal, every, mem_every, disk_every, shm).items()
                 if not only or k in only}
    schedule = kill_schedule(seed, window, *GAP_S, ranks=2)
    res = alternating_trials(reps, list(all_sides), lambda name: trial(work, all_sides[name], window, schedule,
                                                                       cal.step_s))
    return figures(res, {k: v.label for k, v in all_sides.items()}, cal, every, disk_every, window)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="wall window per side and repetition")
    ap.add_argument("--reps", type=int, default=1, help="repetitions per side (sides alternate)")
    ap.add_argument("--seed", type=int, default=31, help="seed of the kill schedule")
    ap.add_argument("--micro-batches", type=int, default=None, help="skip the calibration of the step's size")
    ap.add_argument("--disk-every", type=int, default=20, help="rlsup's drain of the memory tier to disk")
    ap.add_argument("--sides", default="", help="a subset of rlsup,rlsup/sync,rlsup/sync-cold,rlsup/k,ft,torchrun (default: all)")
    ap.add_argument("--dir", default=None, help="scratch directory")
    args = ap.parse_args()
    return print_figures("rlsup-recovery-", args.dir, lambda work: run(
        work, args.minutes, args.reps, args.seed, args.micro_batches, args.disk_every,
        tuple(x for x in args.sides.split(",") if x)))


if __name__ == "__main__":
    sys.exit(main())
