"""The price of rlsup when nothing fails (issue 41): the same trainer, the same save cadence, no faults, under bare
torchrun and under ``rlsup run`` with its defaults and with the memory tier.

    .venv/bin/python benchmarks/bench_overhead.py                     # 5 repetitions per side, 240 steps each
    .venv/bin/python benchmarks/bench_overhead.py --reps 3 --steps 120 --micro-batches 2
    .venv/bin/python benchmarks/run.py --only overhead                # the same, as run.py's table rows

Trainer: benchmarks/jobs/recovery_trainer.py (2 ranks, torchrun, gloo, CPU; an MLP of ``--width``, SGD with
momentum: 67 MB of state per rank at the default width 2048), ``--micro-batches`` forward/backward passes per step
(about 0.05 s each on this machine at the default width), ``trainer_hooks.heartbeat(step)`` every step and a
synchronous ``CheckpointManager.save`` every ``--every`` steps (keep_last 2) on every side: outside rlsup the
manager writes straight to the checkpoint directory, under rlsup's defaults too, and under the memory tier it
writes into ``/dev/shm`` and rlsup drains each new valid step to the checkpoint directory in the background.

Sides (alternating: A/B/C, C/B/A, ...; each trial a fresh directory and fresh processes):

    torchrun      torchrun --standalone --nproc-per-node 2 (its default --max-restarts 0)
    rlsup         rlsup run -- torchrun ...: defaults (warm launcher and warm ranks, auto hang timeout, a metrics
                  endpoint on a free port, --max-restarts 3), --stop-grace/--kill-grace 2 (teardown only)
    rlsup+memory  the same with --memory-dir /dev/shm/... (disk_every 0: every new valid step drained to disk)

Figures, from rank 0's own ``time.monotonic()`` events, over the steady state (the steps after ``--skip``, so
interpreter start, rendezvous, the warm launcher's and warm ranks' imports are left out):

    step          median of the step's own duration (compute + all-reduce + optimizer; the save excluded)
    wall/step     (time of the last step - time of step ``skip``) / steps between: everything the loop waited
                  for, saves included
    save          median time a save blocked the loop
    end-to-end    launch -> the launcher exited (start-up, training, teardown, rlsup's final drain); split into
                  launch -> rank 0's first step and rank 0 done -> the launcher exited
    CPU           over the same window, psutil ``cpu_times`` of each process of the launcher's tree, by role: the
                  ranks, the torchrun agent, rlsup's own process (its threads), and rlsup's helpers (warm
                  launcher, warm ranks, anything else it started; reaped children included), per second of wall

Overhead = rlsup median / torchrun median - 1 (per figure; medians over the repetitions).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

from jobctl import Figure, alternate, events, failed, launch, log, print_figures, stop  # noqa: E402

TRAINER = BENCH / "jobs" / "recovery_trainer.py"
SIDES = ("torchrun", "rlsup", "rlsup+memory")
ROLES = ("ranks", "agent", "rlsup", "helpers")


@dataclass(frozen=True)
class Settings:
    """One run's sizes: the trainer's and the steady-state window's."""

    steps: int = 240
    skip: int = 60  # steady state from this step on
    every: int = 20  # a save every this many steps
    width: int = 2048
    micro_batches: int = 3
    reps: int = 5


@dataclass(frozen=True)
class Trial:
    """One side's run: seconds, and CPU seconds per wall second by role (None: not measured)."""

    side: str
    step_s: float
    wall_per_step_s: float
    save_s: float | None
    end_to_end_s: float
    startup_s: float  # launch -> rank 0's first step done
    teardown_s: float  # rank 0 done -> the launcher exited
    cpu: dict[str, float] = field(default_factory=dict)
    load: float = 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_snapshot(root: int, rank_pids: set[int], is_rlsup: bool) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds) for the launcher's tree. The rlsup process's reaped children count as helpers
    (a key of their own, -root)."""
    import psutil

    try:
        top = psutil.Process(root)
        tree = [top, *top.children(recursive=True)]
    except psutil.Error:
        return {}
    ranks = set(rank_pids)
    agents: set[int] = set()
    for p in tree:  # a rank's descendants (an async writer) are the rank's; its parent is the agent
        with contextlib.suppress(psutil.Error):
            if p.pid in rank_pids:
                agents.add(p.ppid())
                ranks.update(c.pid for c in p.children(recursive=True))
    out: dict[int, tuple[str, float]] = {}
    for p in tree:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            if p.pid in ranks:
                role = "ranks"
            elif p.pid in agents or (p.pid == root and not is_rlsup):
                role = "agent"
            elif p.pid == root:
                role = "rlsup"
                out[-root] = ("helpers", t.children_user + t.children_system)
            else:
                role = "helpers"
            out[p.pid] = (role, t.user + t.system)
    return out


def cpu_rates(a: dict[int, tuple[str, float]], b: dict[int, tuple[str, float]], seconds: float) -> dict[str, float]:
    """CPU seconds per wall second by role between two snapshots (a process born in between counts from 0; one
    that ended in between is lost, as is a reaped grandchild's)."""
    rates = dict.fromkeys(ROLES, 0.0)
    for pid, (role, cpu) in b.items():
        rates[role] += max(0.0, cpu - a.get(pid, (role, 0.0))[1]) / seconds
    return rates


def trial(work: Path, side: str, s: Settings) -> Trial | None:
    """One fault-free run of ``side``; None (and the output's tail logged) when it did not finish cleanly."""
    d = Path(tempfile.mkdtemp(prefix=f"overhead-{side.replace('+', '-')}-", dir=work))
    shm = (Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())) / f"rlsup-overhead-{d.name}"
    extra: list[str] = []
    if side.startswith("rlsup"):
        extra = ["--metrics-port", str(free_port())]  # the endpoint runs, as by default (jobctl's env turns it off)
        if side == "rlsup+memory":
            extra += ["--memory-dir", str(shm)]
    targs = ["--steps", str(s.steps), "--width", str(s.width), "--micro-batches", str(s.micro_batches),
             "--saver", "hooks", "--checkpoint-every", str(s.every)]
    t0 = time.monotonic()
    proc = launch("rlsup" if side.startswith("rlsup") else "torchrun", d, targs,
                  max_restarts=3 if side.startswith("rlsup") else 0, extra=extra, trainer=TRAINER)
    snaps: dict[str, tuple[float, dict]] = {}
    deadline = t0 + 300 + s.steps * 5.0
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            evs = events(d)
            steps = [e["step"] for e in evs if e["ev"] == "step" and e["rank"] == 0]
            mark = "a" if "a" not in snaps and steps and max(steps) >= s.skip else \
                "b" if "a" in snaps and "b" not in snaps and steps and max(steps) >= s.steps - 1 else None
            if mark:
                ranks = {e["pid"] for e in evs if e["ev"] == "start"}
                snaps[mark] = (time.monotonic(), cpu_snapshot(proc.pid, ranks, side.startswith("rlsup")))
        rc = proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        rc = None
    t_exit = time.monotonic()
    end_to_end = t_exit - t0
    stop(proc)
    evs = [e for e in events(d) if e["rank"] == 0]
    shutil.rmtree(shm, ignore_errors=True)
    done = any(e["ev"] == "done" for e in evs)
    if rc != 0 or not done:
        failed(d, f"overhead {side}: exit {rc}, rank 0 done: {done}")
        shutil.rmtree(d, ignore_errors=True)
        return None
    shutil.rmtree(d, ignore_errors=True)
    step_t = {e["step"]: e for e in evs if e["ev"] == "step"}
    steady = [e for e in step_t.values() if e["step"] > s.skip]
    saves = [e["dur"] for e in evs if e["ev"] == "save" and e["step"] > s.skip]
    last = max(step_t)
    t_done = next(e["t"] for e in evs if e["ev"] == "done")
    cpu: dict[str, float] = {}
    if "a" in snaps and "b" in snaps:
        cpu = cpu_rates(snaps["a"][1], snaps["b"][1], snaps["b"][0] - snaps["a"][0])
    res = Trial(side, statistics.median(e["dur"] for e in steady),
                (step_t[last]["t"] - step_t[s.skip]["t"]) / (last - s.skip),
                statistics.median(saves) if saves else None, end_to_end, step_t[min(step_t)]["t"] - t0,
                t_exit - t_done, cpu, os.getloadavg()[0])
    log(f"overhead {side}: step {res.step_s * 1e3:.1f} ms, wall/step {res.wall_per_step_s * 1e3:.1f} ms, save "
        f"{(res.save_s or 0) * 1e3:.0f} ms, end-to-end {end_to_end:.1f} s (to first step {res.startup_s:.1f}, "
        f"done to exit {res.teardown_s:.1f}), CPU/s "
        f"{ {k: round(v, 3) for k, v in cpu.items()} }, load {res.load:.1f}")
    return res


def run(work: Path, s: Settings) -> tuple[list[Figure], dict[str, list[Trial]]]:
    """Every side ``s.reps`` times, alternating; the table's rows and the trials."""
    res: dict[str, list[Trial]] = {k: [] for k in SIDES}
    fails: dict[str, int] = dict.fromkeys(SIDES, 0)
    for _, side in alternate(s.reps, list(SIDES)):
        t = trial(work, side, s)
        if t is None:
            fails[side] += 1
        else:
            res[side].append(t)
    return figures(res, fails, s), res


def med(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def pct(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{100 * (a / b - 1):+.1f} %"


def figures(res: dict[str, list[Trial]], fails: dict[str, int], s: Settings) -> list[Figure]:
    def m(side: str, attr: str) -> float | None:
        return med([getattr(t, attr) for t in res[side]])

    def cpu(side: str, role: str) -> float | None:
        return med([t.cpu[role] for t in res[side] if t.cpu])

    base = "torchrun"
    head = (f"{s.steps} steps, steady from step {s.skip}, {s.micro_batches} micro-batches of width {s.width}, "
            f"save every {s.every}")
    failed_note = "; ".join(f"{k}: {n} trial(s) failed" for k, n in fails.items() if n)
    loads = "/".join(f"{t.load:.1f}" for ts in res.values() for t in ts)
    rows: list[Figure] = []
    for side, label in (("rlsup", "rlsup defaults"), ("rlsup+memory", "rlsup memory tier")):
        per = {a: (m(side, a), m(base, a)) for a in ("step_s", "wall_per_step_s", "save_s", "end_to_end_s",
                                                       "startup_s", "teardown_s")}
        trials = ", ".join(f"{t.wall_per_step_s * 1e3:.1f}" for t in res[side])
        base_trials = ", ".join(f"{t.wall_per_step_s * 1e3:.1f}" for t in res[base])
        note = "; ".join(x for x in [
            f"{head}; {len(res[side])} vs {len(res[base])} trials, alternating",
            f"overhead: step {pct(*per['step_s'])}, wall/step {pct(*per['wall_per_step_s'])}, "
            f"end-to-end {pct(*per['end_to_end_s'])}",
            f"save blocked {fmt_ms(per['save_s'][0])} vs {fmt_ms(per['save_s'][1])}",
            f"wall/step per trial (ms) {side}: {trials}; {base}: {base_trials}", failed_note,
            f"load at trial ends {loads}"] if x)
        rows += [Figure(f"no faults, steady step (compute, saves excluded): {label} vs bare torchrun",
                        ms(per["step_s"][0]), ms(per["step_s"][1]), "ms", note),
                 Figure(f"no faults, steady wall per step (saves included): {label} vs bare torchrun",
                        ms(per["wall_per_step_s"][0]), ms(per["wall_per_step_s"][1]), "ms",
                        f"overhead {pct(*per['wall_per_step_s'])}"),
                 Figure(f"no faults, end-to-end wall of {s.steps} steps: {label} vs bare torchrun",
                        per["end_to_end_s"][0], per["end_to_end_s"][1], "s",
                        f"overhead {pct(*per['end_to_end_s'])}; launch -> first step {fmt_s(per['startup_s'][0])} vs "
                        f"{fmt_s(per['startup_s'][1])}, rank 0 done -> launcher exited {fmt_s(per['teardown_s'][0])} "
                        f"vs {fmt_s(per['teardown_s'][1])}")]
        roles = {r: cpu(side, r) for r in ROLES}
        ours = None if roles["rlsup"] is None else 100 * (roles["rlsup"] + roles["helpers"] + roles["agent"])
        agent = cpu(base, "agent")
        rows.append(Figure(f"no faults, steady CPU besides the ranks: {label} (rlsup + helpers + agent) vs torchrun "
                           f"agent", ours, None if agent is None else 100 * agent, "% of a core",
                           "; ".join(f"{r} {100 * v:.1f}" for r, v in roles.items() if v is not None)
                           + f" (% of a core); ranks under torchrun {pct_core(cpu(base, 'ranks'))}; rlsup + helpers "
                           f"= {share(roles)} of the ranks' CPU"
                           if ours is not None else "n/a: no trial reached the steady window's end before it exited"))
    return rows


def share(roles: dict[str, float | None]) -> str:
    """rlsup's own and its helpers' CPU as a share of the ranks' (an upper bound under load: rlsup polls at a fixed
    rate while the ranks' share of the cores falls)."""
    if roles["rlsup"] is None or not roles["ranks"]:
        return "n/a"
    return f"{100 * (roles['rlsup'] + roles['helpers']) / roles['ranks']:.1f} %"


def ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def pct_core(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def fmt_s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def fmt_ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.0f} ms"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Settings()
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--skip", type=int, default=d.skip, help="steady state from this step on")
    ap.add_argument("--every", type=int, default=d.every, help="a save every this many steps")
    ap.add_argument("--width", type=int, default=d.width)
    ap.add_argument("--micro-batches", type=int, default=d.micro_batches)
    ap.add_argument("--reps", type=int, default=d.reps, help="repetitions per side (sides alternate)")
    ap.add_argument("--dir", default=None, help="scratch directory")
    args = ap.parse_args()
    if not 0 < args.skip < args.steps - 1:
        ap.error(f"--skip {args.skip} must be between 1 and --steps - 2 ({args.steps - 2})")
    s = Settings(args.steps, args.skip, args.every, args.width, args.micro_batches, args.reps)
    log(f"overhead: {s}; {os.cpu_count()} cores, load {os.getloadavg()}")
    return print_figures("rlsup-overhead-", args.dir, lambda work: run(work, s)[0])


if __name__ == "__main__":
    sys.exit(main())
