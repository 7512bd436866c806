"""rlsup against what users run today: one line per figure, rlsup median vs baseline median.

    .venv/bin/python benchmarks/run.py --quick            # < 5 min on 2 cores
    .venv/bin/python benchmarks/run.py                    # full, ~15-20 min
    .venv/bin/python benchmarks/run.py --only restart,hang --reps 3

Every benchmark runs rlsup and its baseline alternately (rlsup first on even repetitions, the baseline
first on odd ones) and prints, as soon as a figure is done, one row per figure::

    name | rlsup median | baseline median | ratio (rlsup / baseline) | unit | note

Figures (``--only`` keys): restart, hang, save, heartbeat, selection, replication, restore, footprint,
goodput, gpu_check, flight_recorder, watch_cpu, writer_start; and recovery (issue 31's realistic harness, benchmarks/bench_recovery.py),
node_loss (its node-loss variant, a spare against a replacement: benchmarks/bench_node_loss.py), overhead (issue
41: what rlsup costs when nothing fails, benchmarks/bench_overhead.py) and shrink (issue 43: a job that goes on with
2 of its 3 nodes against a spare's takeover, benchmarks/bench_shrink.py; ``--quick --only shrink`` about 3 min, node 0 lost with etcd beside),
run only when named. Jobs are 2-rank torchrun/gloo runs of ``benchmarks/jobs/bench_trainer.py``, which writes
``time.monotonic()`` events (CLOCK_MONOTONIC is system-wide on Linux, so ranks, attempts and this script share one
clock). Method, machine and results: BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import contextlib
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(ROOT), str(BENCH), str(ROOT / "tests")]

from jobctl import (BIN, PY, alternate, events, failed, job_env, launch, log, nvrx_missing,  # noqa: E402
                    pid_alive, stop, wait_until)

FIGURES = ("restart", "hang", "hang_restart", "save", "heartbeat", "selection", "replication", "restore", "footprint", "goodput",
           "gpu_check", "flight_recorder", "watch_cpu", "writer_start", "warm_fork")


# ------------------------------------------------------------------------------------------ output


@dataclass
class Row:
    name: str
    rlsup: float | None
    base: float | None
    unit: str
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.rlsup is None or self.base is None or self.base == 0:
            return None
        return self.rlsup / self.base


def fmt(x: float | None) -> str:
    if x is None:
        return "n/a"
    if x == 0:
        return "0"
    a = abs(x)
    if a >= 1000:
        return f"{x:.0f}"
    if a >= 100:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    if a >= 0.01:
        return f"{x:.3f}"
    return f"{x:.2e}"


HEADER = f"{'name':<72} | {'rlsup median':>12} | {'baseline median':>15} | {'ratio':>7} | {'unit':<6} | note"


def print_row(row: Row) -> None:
    ratio = "n/a" if row.ratio is None else f"{row.ratio:.2f}"
    print(f"{row.name:<72} | {fmt(row.rlsup):>12} | {fmt(row.base):>15} | {ratio:>7} | {row.unit:<6} | {row.note}",
          flush=True)


def markdown_table(rows: list[Row]) -> str:
    """The rows as BENCHMARKS.md shows them (pipes in names and notes escaped)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    out = ["| figure | rlsup median | baseline median | ratio | unit | note |",
           "| --- | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        ratio = "n/a" if r.ratio is None else f"{r.ratio:.2f}"
        out.append(f"| {cell(r.name)} | {fmt(r.rlsup)} | {fmt(r.base)} | {ratio} | {r.unit} | {cell(r.note)} |")
    return "\n".join(out) + "\n"


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# ------------------------------------------------------------------------------------------ context


@dataclass
class Ctx:
    quick: bool
    reps: int
    work: Path
    layouts: list[str] | None = None
    recovery_minutes: float = 5.0
    recovery_reps: int = 1
    node_loss_reps: int = 2
    shrink_reps: int = 2

    def fresh(self, name: str) -> Path:
        d = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.work))
        return d


# ------------------------------------------------------------------------------------------ 1. restart

#: Where a recovery's time goes, from the fault to the next attempt's first step (rank 0's events):
#: detect + teardown + launch (fault -> the next attempt's rank 0 runs its first line: an interpreter
#: and ``import torch`` when cold, a hand-off when warm), rendezvous (``init_process_group``), restore,
#: first step.
PHASES = ("fault->rank start", "rendezvous", "restore", "first step")


def recovery_phases(evs: list[dict], fault_t: float, attempt: int) -> tuple[float, ...]:
    """The :data:`PHASES` of one recovery, in seconds (StopIteration when an event is missing)."""
    def first(ev: str) -> float:
        return next(e["t"] for e in evs if e["ev"] == ev and e["attempt"] == attempt and e["rank"] == 0)

    marks = [fault_t, first("start"), first("rendezvous"), first("resumed"), first("step")]
    return tuple(b - a for a, b in zip(marks, marks[1:]))



def bench_restart(ctx: Ctx) -> list[Row]:
    """SIGKILL of rank 1 (its own event, just before) -> rank 0 of the next attempt completes a step."""
    kinds = ["rlsup", "torchrun"]
    why_no_ft = nvrx_missing()
    if why_no_ft is None:
        kinds.append("ft")
    targs = ["--steps", "40", "--checkpoint-every", "5", "--crash-at-step", "12", "--step-time", "0.02"]
    lat: dict[str, list[float]] = {k: [] for k in kinds}
    breakdown: dict[str, list[tuple[float, ...]]] = {k: [] for k in kinds}  # PHASES per trial
    downtime: list[float] = []  # rlsup's own record: attempt ended -> next attempt launched
    fails: dict[str, list[str]] = {k: [] for k in kinds}
    for _, kind in alternate(ctx.reps, kinds):
        d = ctx.fresh(f"restart-{kind}")
        t_trial = time.monotonic()
        proc = launch(kind, d, targs, max_restarts=1)

        def first_step_of_next() -> dict | None:
            return next((e for e in events(d) if e["ev"] == "step" and e["attempt"] == 1), None)

        # The crash comes a few seconds after launch; then the next attempt gets `patience` s to train.
        wait_until(lambda: next((e for e in events(d) if e["ev"] == "kill"), None) or proc.poll() is not None, 120)
        patience = 30 if ctx.quick else 60  # a torchrun restart that has not trained by then never will
        wait_until(lambda: first_step_of_next() or proc.poll() is not None, patience)
        nxt = first_step_of_next()
        evs = events(d)
        kill = next((e for e in evs if e["ev"] == "kill"), None)
        rc = proc.poll()  # None: still running when we gave up waiting
        stop(proc)
        if kill is not None and nxt is not None:
            lat[kind].append(nxt["t"] - kill["t"])
            with contextlib.suppress(StopIteration, ValueError):
                breakdown[kind].append(recovery_phases(evs, kill["t"], 1))
            with contextlib.suppress(OSError, ValueError, IndexError, KeyError, TypeError):
                inc = (d / "state" / "incidents.jsonl").read_text().splitlines()
                downtime.append(float(json.loads(inc[0])["downtime_s"]))
        else:
            text = (d / "output.log").read_text(errors="replace")
            if kill is None:
                cause = "no crash recorded"
            elif "connectFullMesh" in text:
                cause = "connectFullMesh refused"
            elif any(e["ev"] == "start" and e["attempt"] == 1 for e in evs):
                cause = "next attempt started, never trained" + (f" (exit {rc})" if rc is not None else f" in {patience} s")
            else:
                cause = f"no next attempt (exit {rc})"
            fails[kind].append(cause)
            failed(d, f"restart {kind}: failed ({cause})")
            continue
        log(f"restart {kind}: {lat[kind][-1]:.2f} s (trial {time.monotonic() - t_trial:.0f} s)")
        shutil.rmtree(d, ignore_errors=True)

    def note(k: str) -> str:
        n = len(lat[k]) + len(fails[k])
        parts = [f"{k}: {len(fails[k])}/{n} restarts failed ({', '.join(sorted(set(fails[k])))})"] if fails[k] else []
        return "; ".join(parts)

    def phases(k: str) -> str:
        if not breakdown[k]:
            return ""
        cols = list(zip(*breakdown[k]))
        return f"{k}: " + " + ".join(f"{name} {fmt(median(list(col)))}" for name, col in zip(PHASES, cols)) + " s"

    rl_phases = phases("rlsup") + (f" (rlsup downtime, attempt end noticed -> next launched: "
                                   f"{fmt(median(downtime))} s)" if downtime else "")
    rows = [Row("restart latency: SIGKILL -> next first step, vs torchrun --max-restarts 1", median(lat["rlsup"]),
                median(lat["torchrun"]), "s",
                "; ".join(x for x in [note("rlsup"), note("torchrun"), rl_phases, phases("torchrun")] if x))]
    if "ft" in kinds:
        rows.append(Row("restart latency: SIGKILL -> next first step, vs ft_launcher --max-restarts 1",
                        median(lat["rlsup"]), median(lat["ft"]), "s",
                        "; ".join(x for x in [note("ft"), phases("ft")] if x)))
    else:
        rows.append(Row("restart latency: SIGKILL -> next first step, vs ft_launcher --max-restarts 1",
                        median(lat["rlsup"]), None, "s", f"n/a: {why_no_ft}"))
    return rows


# ------------------------------------------------------------------------------------------ 2. hang


def bench_hang(ctx: Ctx) -> list[Row]:
    """Rank 1 stops heartbeating (sleeps forever) after step 100 of fast (20 ms) steps: time until the
    launcher says so in its log (detected), and until the hung rank is gone (killed)."""
    import torch.distributed.constants as c10d_constants

    kinds = ["rlsup"]
    why_no_ft = nvrx_missing()
    if why_no_ft is None:
        kinds.append("ft")
    # Step 100 (~2.5 s of training): rlsup's auto timeout needs auto_timeout_min_intervals (5) heartbeat
    # intervals seen by its 0.1 s poll before it replaces heartbeat_timeout_initial (600 s).
    targs = ["--hang-at-step", "100", "--checkpoint-every", "10", "--step-time", "0.02"]
    extra = {
        # auto timeout: 5 x the longest step interval seen, at least the floor (2 s) once 5 intervals were seen
        "rlsup": ["--auto-timeout-floor", "2", "--heartbeat-timeout", "auto"],
        # NVRx: the same 2 s after the first heartbeat, checked as often as rlsup polls (0.1 s)
        "ft": ["--ft-workload-check-interval", "0.1", "--ft-initial-rank-heartbeat-timeout", "120",
               "--ft-rank-heartbeat-timeout", "2"],
    }
    marker = {"rlsup": "hang detected", "ft": "Did not get subsequent heartbeat"}
    detect: dict[str, list[float]] = {k: [] for k in kinds}
    killed: dict[str, list[float]] = {k: [] for k in kinds}
    learned: list[float] = []
    fails: dict[str, int] = {k: 0 for k in kinds}
    for _, kind in alternate(ctx.reps, kinds):
        d = ctx.fresh(f"hang-{kind}")
        proc = launch(kind, d, targs, max_restarts=0, extra=extra[kind])
        hang = wait_until(lambda: next((e for e in events(d) if e["ev"] == "hang"), None) or proc.poll() is not None,
                          120, 0.02)
        seen_at = dead_at = None
        if isinstance(hang, dict):
            deadline = time.monotonic() + 150  # an auto timeout can be long when a step (a save) was slow
            while time.monotonic() < deadline and (seen_at is None or dead_at is None):
                now = time.monotonic()
                if seen_at is None and marker[kind] in (d / "output.log").read_text(errors="replace"):
                    seen_at = now
                if dead_at is None and not pid_alive(hang["pid"]):
                    dead_at = now
                if proc.poll() is not None and dead_at is not None:
                    break
                time.sleep(0.01)
        if kind == "rlsup":  # "hang detected: rank R (pid P) silent for X s > heartbeat_timeout T s"
            import re

            m = re.search(r"> heartbeat_timeout ([0-9.]+)s", (d / "output.log").read_text(errors="replace"))
            if m:
                learned.append(float(m.group(1)))
        stop(proc)
        if dead_at is None or seen_at is None:
            fails[kind] += 1
            failed(d, f"hang {kind}: not detected (hang event: {hang!r}, exit {proc.returncode})")
            continue
        detect[kind].append(seen_at - hang["t"])
        killed[kind].append(dead_at - hang["t"])
        log(f"hang {kind}: detected {detect[kind][-1]:.2f} s, killed {killed[kind][-1]:.2f} s")
        shutil.rmtree(d, ignore_errors=True)
    pg = c10d_constants.default_pg_timeout.total_seconds()
    nccl_td = getattr(c10d_constants, "default_pg_nccl_timeout", None)
    nccl = f"{nccl_td.total_seconds():.0f} s" if nccl_td is not None else "None in this CPU build; 600 s in CUDA builds"
    fail_note = "; ".join(f"{k}: {n} not detected in 150 s" for k, n in fails.items() if n)
    learned_note = f"rlsup learned timeout {'/'.join(f'{x:.1f}' for x in learned)} s" if learned else ""
    ft_name = "ft_launcher rank-heartbeat-timeout 2 s"
    rows = [
        Row("hang -> detected: rlsup auto timeout vs plain torchrun", median(detect["rlsup"]), pg, "s",
            f"torchrun has no hang detection: ranks wait for the collective timeout, gloo default_pg_timeout "
            f"{pg:.0f} s (NCCL default_pg_nccl_timeout: {nccl}); not waited"),
    ]
    for label, data in (("detected", detect), ("hung rank killed", killed)):
        note = "; ".join(x for x in [learned_note if label == "detected" else
                                     "rlsup dumps every rank's stacks before it kills", fail_note] if x)
        rows.append(Row(f"hang -> {label}: rlsup auto (floor 2 s) vs {ft_name}", median(data["rlsup"]),
                        median(data["ft"]) if "ft" in kinds else None, "s",
                        note if "ft" in kinds else f"n/a: {why_no_ft}"))
    return rows


def bench_hang_restart(ctx: Ctx) -> list[Row]:
    """Rank 1 hangs (stops heartbeating) at step 40; both launchers use a 3 s heartbeat timeout and one
    restart: hang -> rank 0 of the next attempt completes a step."""
    why_no_ft = nvrx_missing()
    if why_no_ft is not None:
        return [Row("hang -> next first step, 3 s heartbeat timeout, vs ft_launcher", None, None, "s",
                    f"n/a: {why_no_ft}")]
    targs = ["--hang-at-step", "40", "--checkpoint-every", "10", "--step-time", "0.02"]
    extra = {"rlsup": ["--heartbeat-timeout", "3"],
             "ft": ["--ft-workload-check-interval", "0.1", "--ft-initial-rank-heartbeat-timeout", "120",
                    "--ft-rank-heartbeat-timeout", "3"]}
    lat: dict[str, list[float]] = {k: [] for k in extra}
    breakdown: dict[str, list[tuple[float, ...]]] = {k: [] for k in extra}
    fails: dict[str, int] = {k: 0 for k in extra}
    for _, kind in alternate(ctx.reps, list(extra)):
        d = ctx.fresh(f"hangrestart-{kind}")
        proc = launch(kind, d, targs, max_restarts=1, extra=extra[kind])

        def first_step_of_next() -> dict | None:
            return next((e for e in events(d) if e["ev"] == "step" and e["attempt"] == 1), None)

        wait_until(lambda: first_step_of_next() or proc.poll() is not None, 120)
        evs, nxt = events(d), first_step_of_next()
        hang = next((e for e in evs if e["ev"] == "hang"), None)
        stop(proc)
        if hang is None or nxt is None:
            fails[kind] += 1
            failed(d, f"hang-restart {kind}: no next first step (hang event: {hang is not None})")
            continue
        lat[kind].append(nxt["t"] - hang["t"])
        with contextlib.suppress(StopIteration, ValueError):
            breakdown[kind].append(recovery_phases(evs, hang["t"], 1))
        log(f"hang-restart {kind}: {lat[kind][-1]:.2f} s")
        shutil.rmtree(d, ignore_errors=True)

    def phases(k: str) -> str:
        if not breakdown[k]:
            return ""
        cols = list(zip(*breakdown[k]))
        names = ("hang->rank start (incl. the 3 s timeout)", *PHASES[1:])
        return f"{k}: " + " + ".join(f"{n} {fmt(median(list(c)))}" for n, c in zip(names, cols)) + " s"

    note = "; ".join(x for x in [phases("rlsup"), phases("ft")] +
                     [f"{k}: {n} failed" for k, n in fails.items() if n] if x)
    return [Row("hang -> next first step, 3 s heartbeat timeout, vs ft_launcher", median(lat["rlsup"]),
                median(lat["ft"]), "s", note)]


# ------------------------------------------------------------------------------------------ 3. save, heartbeat


def bench_save(ctx: Ctx) -> list[Row]:
    import torch

    import bench_save as bs
    from trainer_hooks.checkpoint import CheckpointManager
    from trainer_hooks.step_writer import wait_for_removals

    rows = []
    for size_mb in ([100] if ctx.quick else [100, 1024]):
        state = bs.make_state(size_mb)
        d = ctx.fresh(f"save-{size_mb}")
        mgr = CheckpointManager(d / "ckpt", keep_last=1)
        times: dict[str, list[float]] = {"rlsup": [], "torch.save": [], "torch.save+fsync": []}
        # This VM's page cache is slow and uneven to grow (2-4x between repetitions): a first, untimed
        # round of every side, then 3x the repetitions, and medians.
        reps = 1 + (3 * max(3, ctx.reps) if not ctx.quick else max(3, ctx.reps))
        for r, kind in alternate(reps, list(times)):
            t0 = time.perf_counter()
            if kind == "rlsup":
                mgr.save(r + 1, state)
            elif kind == "torch.save":
                torch.save(state, d / "plain.pt")
            else:
                with open(d / "plainfs.pt", "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
            if r:
                times[kind].append(time.perf_counter() - t0)
            for name in ("plain.pt", "plainfs.pt"):
                (d / name).unlink(missing_ok=True)
            # Untimed, after every side: the freed blocks' discards (this disk is mounted with
            # `discard`) and retention's background removal land before the next side starts.
            wait_for_removals()
            os.sync()
        blocked = async_blocking(state, d / "async", max(3, ctx.reps))
        del state
        shutil.rmtree(d, ignore_errors=True)
        label = f"{size_mb} MB" if size_mb < 1000 else f"{size_mb / 1024:.0f} GB"
        rows.append(Row(f"save {label}: training blocked by async_save=True vs a synchronous save",
                        median(blocked), median(times["rlsup"]), "s",
                        "steady state (writer started, staging buffer allocated by a first save); "
                        "the copy to a reusable buffer blocks, the writer process serialises, fsyncs, hashes"))
        note = ("hashed as torch writes (nothing read back), each file and directory fsynced once, manifest; "
                "keep_last=1 (the old step removed in the background)")
        rows.append(Row(f"save {label}: CheckpointManager.save vs torch.save", median(times["rlsup"]),
                        median(times["torch.save"]), "s", note + "; torch.save: page cache, no fsync"))
        rows.append(Row(f"save {label}: CheckpointManager.save vs torch.save + fsync", median(times["rlsup"]),
                        median(times["torch.save+fsync"]), "s", note))
    return rows


def async_blocking(state: dict, directory: Path, reps: int) -> list[float]:
    """Seconds each ``save()`` of ``CheckpointManager(async_save=True)`` blocks the caller, once the writer
    runs and its buffer exists (a first, untimed save); every background write is awaited untimed."""
    from trainer_hooks.checkpoint import CheckpointManager

    mgr = CheckpointManager(directory, keep_last=1, async_save=True)
    try:
        mgr.save(1, state)
        mgr.wait()
        out = []
        for r in range(reps):
            t0 = time.perf_counter()
            mgr.save(r + 2, state)
            out.append(time.perf_counter() - t0)
            if not mgr.wait(timeout=600):
                raise RuntimeError("async save did not finish in 600 s")
        return out
    finally:
        mgr.close()


def bench_heartbeat(ctx: Ctx) -> list[Row]:
    import bench_heartbeat as bh

    blocks, per_block = (15, 500) if ctx.quick else (31, 1000)
    with_hb, without = bh.step_overhead(steps_per_block=per_block, blocks=blocks)
    calls = 50_000 if ctx.quick else 200_000
    under, outside = bh.measure(calls, True), bh.measure(calls, False)
    return [
        Row("training step with heartbeat(step) vs without (4 x 128x128 matmul)", with_hb, without, "us",
            f"alternating blocks of {per_block} steps, {blocks} each, median; budget <= 1% slowdown"),
        Row("heartbeat() call under rlsup (mmap) vs outside rlsup (no-op)", under, outside, "ns",
            f"{calls} calls x 7, median"),
    ]


# ------------------------------------------------------------------------------------------ 4. selection


LAYOUT_KEYS = {"verl-fsdp": "verl (FSDP)", "verl-megatron": "verl (Megatron v2)", "megatron-core": "Megatron-Core",
               "megatron-bridge": "Megatron-Bridge", "dcp": "torch DCP", "areal": "AReaL", "rlsup": "rlsup",
               "hf": "HF Trainer", "deepspeed": "DeepSpeed", "lightning": "Lightning", "nemo": "NeMo 2",
               "nemo-rl": "NeMo-RL", "torchtitan": "torchtitan"}


def _step_in(name: str | None) -> int | None:
    import re

    m = re.search(r"step[=_-]?(\d+)", name or "") or re.search(r"(\d+)$", name or "")
    return int(m.group(1)) if m else None


def _nemo_pick(root: Path) -> int | None:
    from source_builders import nemo_autoresume_pick

    try:
        picked = nemo_autoresume_pick(root)
    except Exception:  # AutoResume raises when the only -last checkpoint is unfinished
        return None
    return _step_in(picked.name) if picked else None


def _hf_pick(root: Path) -> int | None:
    from transformers.trainer_utils import get_last_checkpoint

    return _step_in(get_last_checkpoint(str(root)))


def _lightning_pick(root: Path) -> int | None:
    from lightning_builders import lightning_last_pick

    picked = lightning_last_pick(root)
    return _step_in(os.path.realpath(picked) if picked else None)


def _pick_of(module: str, function: str) -> Callable[[Path], int | None]:
    def pick(root: Path) -> int | None:
        import importlib

        out = getattr(importlib.import_module(module), function)(root)
        return out if isinstance(out, int) else _step_in(getattr(out, "name", out))
    return pick


# What each trainer's own resume picks (its source's logic, reimplemented in the tests' builders, or
# the trainer's own function where it is importable): the baseline of the selection rows.
TRAINER_PICKS: dict[str, Callable[[Path], int | None]] = {
    "hf": _hf_pick, "lightning": _lightning_pick, "nemo": _nemo_pick,
    "deepspeed": _pick_of("deepspeed_builders", "deepspeed_would_load"),
    "nemo-rl": _pick_of("source_builders", "nemo_rl_latest"),
    "torchtitan": _pick_of("source_builders", "torchtitan_find_load_step"),
}


def tracker_baseline(root: Path, layout: str) -> int | None:
    """What a trainer does to find its checkpoint: read the tracker file, or take the highest step number."""
    import re

    if layout in ("verl", "megatron"):
        text = (root / "latest_checkpointed_iteration.txt").read_text().strip()
        return int(text) if text.isdigit() else None
    if layout == "areal":
        return int(json.loads((root / "recover_info" / "step_info.json").read_text())["global_step"])
    if layout in TRAINER_PICKS:
        return TRAINER_PICKS[layout](root)
    steps = [int(m.group(1)) for n in os.listdir(root) if (m := re.search(r"(\d+)$", n))]
    return max(steps) if steps else None


def bench_selection(ctx: Ctx) -> list[Row]:
    import bench_selection as bsel
    import layout_builders as lb

    from supervisor import layouts

    steps = 1000
    keys = ctx.layouts or (["verl-fsdp", "megatron-core", "dcp", "rlsup"] if ctx.quick else list(LAYOUT_KEYS))
    if any(k.startswith(("megatron", "verl-megatron")) for k in keys):
        lb.mcore_dist_template()
    reps = 7 if ctx.quick else 15
    rows = []
    for key in keys:
        label = LAYOUT_KEYS[key]
        layout, build = bsel.BUILDERS[label]
        root = ctx.fresh(f"sel-{key}")
        try:
            build(root, steps)
        except ImportError as e:
            rows.append(Row(f"select newest valid of {steps}: {label}", None, None, "ms", f"skipped: {e}"))
            continue
        n = len(layouts.LAYOUTS[layout].list_steps(root))
        t_rl, t_base = [], []
        picked = base_pick = None
        for _, kind in alternate(reps, ["rlsup", "base"]):
            t0 = time.perf_counter()
            if kind == "rlsup":
                rec = layouts.latest_valid(root)  # auto-detect, as `rlsup run` does by default
                t_rl.append((time.perf_counter() - t0) * 1e3)
                picked = rec.step if rec else None
            else:
                base_pick = tracker_baseline(root, layout)
                t_base.append((time.perf_counter() - t0) * 1e3)
        newest = max(s for s, _ in layouts.LAYOUTS[layout].list_steps(root)) if n else None
        how = ("tracker file" if layout in ("verl", "megatron", "areal") else "the trainer's own pick"
               if layout in TRAINER_PICKS else "highest step number")
        broken = picked != newest
        note = (f"{n} step{'s' if n != 1 else ''}{f', newest ({newest}) broken' if broken else ''}; rlsup picks "
                f"{picked}, baseline ({how}) picks {base_pick}" + (" (the broken one)" if broken and base_pick == newest else ""))
        rows.append(Row(f"select newest valid of {n}: {label} vs {how}", median(t_rl), median(t_base), "ms", note))
        shutil.rmtree(root, ignore_errors=True)
    return rows


# ------------------------------------------------------------------------------------------ 5. replication, restore


def bench_replication(ctx: Ctx) -> list[Row]:
    import bench_replication as br

    size = int((0.2 if ctx.quick else 2.0) * 1e9)
    rows = br.measure(size, runs=max(3, ctx.reps), scratch=str(ctx.work))
    label = f"{size / 1e9:.1f} GB"
    note = ("127.0.0.1, each peer's endpoint its own process; rlsup: HMAC, sendfile, xxh3 verify on receipt, "
            "fsync, rename; 2 peers: a chain (the first peer stores, answers, sends on); baselines synced; "
            "every side's second destination writes to /dev/shm; rlsup's second hop and the second rsync daemon "
            "run at nice 19 (another machine)")
    out = []
    for name, a, b in rows:
        unit = ("x" if "same run" in name else "s" if name.startswith(("sender time", "sender CPU"))
                else "MB" if name.startswith("sender bytes") else "MB/s")
        why = note if b is not None else f"{note}; baseline: {br.RSYNC_MISSING}"
        if unit == "MB":
            why = "data bytes the sender's pushes carry: each file once, whatever the number of peers"
        elif unit == "x":
            why = "per run, the 2-peer push's time over the 1-peer push's beside it, then the median: drift cancels"
        out.append(Row(f"replicate {label}: {name}", a, b, unit, why))
    return out


SECRET = b"benchmark-secret-benchmark-secret"


def bench_restore(ctx: Ctx) -> list[Row]:
    """A node lost its disk: rlsup fetches its part of the newest step from the replica holder (verified,
    manifest last) vs ``cp -r`` of the step from a local copy (+ sync)."""
    import torch

    from supervisor.membership import Membership
    from supervisor.tiers.part_protocol import fetch_part
    from supervisor.tiers.replication import ReplicationEngine, ReplicationSettings
    from supervisor.transport.client import PeerClient
    from supervisor.transport.server import ReplicationServer
    from supervisor.transport.store import ReplicaStore
    from trainer_hooks.checkpoint import CheckpointManager
    from rlsup_format.manifest import step_dir_name

    size = int((0.2 if ctx.quick else 2.0) * 1e9)
    d = ctx.fresh("restore")
    server = ReplicationServer(ReplicaStore(d / "node1-replicas"), SECRET)
    port = server.start()
    client = PeerClient(f"127.0.0.1:{port}", SECRET, retries=0)
    try:
        ckpt = d / "node0" / "checkpoints"
        n = size // 4
        state = {"model": {"w": torch.randn(n // 2)}, "optim": {"m": torch.randn(n - n // 2)}}
        os.environ["RLSUP_JOB_ID"] = "bench"  # as under rlsup: the part names its job, which fetch checks
        try:
            step_dir = CheckpointManager(ckpt).save(100, state)
        finally:
            del os.environ["RLSUP_JOB_ID"]
        del state
        total = sum(p.stat().st_size for p in step_dir.iterdir() if p.is_file())
        membership = Membership(("127.0.0.1:1", f"127.0.0.1:{port}"), 0)
        engine = ReplicationEngine(membership=membership, checkpoint_dir=ckpt, replica_root=d / "node0-replicas",
                                   clients={1: client}, settings=ReplicationSettings(factor=1, jump=1),
                                   state_path=d / "replication.json", job="bench")
        engine.sync()  # node 1 now holds node 0's part of step 100
        local_copy = d / "local-copy"
        shutil.copytree(step_dir, local_copy / step_dir_name(100))
        t_rl, t_cp = [], []
        for _, kind in alternate(max(3, ctx.reps), ["rlsup", "cp"]):
            shutil.rmtree(ckpt, ignore_errors=True)  # the wiped node
            ckpt.mkdir(parents=True)
            t0 = time.perf_counter()
            if kind == "rlsup":  # as NodeGroup._fetch does it: leftovers cleaned, then fetch_part
                engine.clean()
                fetch_part([engine.peer_store(1)], engine.local_store(), 100, 0, accept=engine.accept)
                t_rl.append(time.perf_counter() - t0)
            else:
                subprocess.run(["cp", "-r", str(local_copy / step_dir_name(100)), str(ckpt)], check=True)
                subprocess.run(["sync", "-f", str(ckpt)], check=False)
                t_cp.append(time.perf_counter() - t0)
        return [Row(f"restore a wiped node ({total / 1e9:.1f} GB): fetch from replica vs cp -r local copy",
                    median(t_rl), median(t_cp), "s",
                    "rlsup: HTTP on 127.0.0.1 (sendfile out, recv_into in), fetch_part: files side by side, xxh3 "
                    "on receipt, manifest last, sizes verified after (nothing read again); cp: + sync")]
    finally:
        client.close()
        server.stop()
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------------------ 6. footprint


def _tree(pid: int) -> list:
    import psutil

    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _cpu_s(pid: int) -> float:
    """CPU seconds of a process, its threads and its reaped children, plus its live children."""
    import psutil

    total = 0.0
    for i, p in enumerate(_tree(pid)):
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system + (t.children_user + t.children_system if i == 0 else 0.0)
    return total


def _rss_mb(pid: int) -> float:
    import psutil

    total = 0
    for p in _tree(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total / 2**20


def _sample(pids: list[int], until: Callable[[], bool], timeout: float) -> tuple[list[float], list[float], float]:
    """Peak RSS (MB) and CPU seconds of each pid's tree while ``until()`` is false; and the elapsed time."""
    cpu0 = [_cpu_s(p) for p in pids]
    peak = [_rss_mb(p) for p in pids]
    t0 = time.monotonic()
    while not until() and time.monotonic() - t0 < timeout:
        time.sleep(0.02)
        peak = [max(a, _rss_mb(p)) for a, p in zip(peak, pids)]
    elapsed = time.monotonic() - t0
    # A forked worker (the rsync daemon's receiver) counts in its parent's children times only once
    # reaped: wait for that (bounded) before the last reading, or its CPU is lost.
    wait_until(lambda: all(len(_tree(p)) <= 1 for p in pids), 10)
    return peak, [_cpu_s(p) - c for p, c in zip(pids, cpu0)], elapsed


def bench_footprint(ctx: Ctx) -> list[Row]:
    import torch

    import bench_replication as br
    from trainer_hooks.checkpoint import CheckpointManager
    from rlsup_format.manifest import manifest_name, step_dir_name

    d = ctx.fresh("footprint")
    token = d / "token"
    token.write_text("benchmark-secret-benchmark-secret\n")
    token.chmod(0o600)
    ports = [br.free_port(), br.free_port()]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    daemons: list[subprocess.Popen] = []
    rsyncd = None
    try:
        for node in range(2):
            nd = d / f"node{node}"
            nd.mkdir()
            daemons.append(subprocess.Popen(
                [PY, "-m", "supervisor.cli.main", "daemon", "--peers", peers, "--node-rank", str(node), "--token-file",
                 str(token), "--replication-factor", "1", "--replication-scan-interval", "30"],
                cwd=nd, env=job_env(), stdout=open(nd / "daemon.log", "wb"), stderr=subprocess.STDOUT))
        if not wait_until(lambda: all((d / f"node{n}" / ".rlsup" / "daemon.json").exists() for n in range(2)), 60):
            raise RuntimeError(f"rlsup daemons did not start (logs in {d})")
        rsync_dest = d / "rsync-dest"
        rsync_dest.mkdir()
        rsyncd = br.RsyncDaemon(d, rsync_dest) if shutil.which("rsync") else None
        time.sleep(1.0)  # let both settle after startup
        window = 4.0 if ctx.quick else 8.0
        idle: dict[str, list[tuple[float, float]]] = {"rlsup": [], "rsync": []}
        for _, kind in alternate(max(2, ctx.reps), ["rlsup", "rsync"]):
            if kind == "rsync" and rsyncd is None:
                continue
            pid = daemons[0].pid if kind == "rlsup" else rsyncd.proc.pid
            end = time.monotonic() + window
            peak, cpu, el = _sample([pid], lambda: time.monotonic() > end, window + 1)
            idle[kind].append((peak[0], 100 * cpu[0] / el))
        # replicating: a fresh step appears on node 0; its daemon pushes it to node 1
        size = int((0.2 if ctx.quick else 1.0) * 1e9)
        n = size // 4
        state = {"w": torch.randn(n)}
        staging = d / "staging"
        rep: dict[str, list[tuple]] = {"rlsup": [], "rsync": []}
        for r, kind in alternate(max(2, ctx.reps), ["rlsup", "rsync"]):
            if kind == "rsync" and rsyncd is None:
                continue
            step = 100 + r
            if kind == "rlsup":
                # saved straight into node 0's checkpoint directory: the manifest, written last, wakes its daemon
                dst = CheckpointManager(d / "node0" / "checkpoints").save(step, state)
                from supervisor.job_identity import job_identity, namespace_of

                ns = namespace_of(job_identity("", "checkpoints", True, environ={}, peers=peers.split(",")).id, 0)  # the daemons' default job
                replica = d / "node1" / "replicas" / ns / step_dir_name(step) / manifest_name(0)
                peak, cpu, el = _sample([daemons[0].pid, daemons[1].pid], replica.exists, 300)
                shutil.rmtree(dst, ignore_errors=True)
            else:
                src = CheckpointManager(staging).save(step, state)
                proc = subprocess.Popen(["rsync", "-a", "--whole-file", f"{src}/",
                                         f"rsync://127.0.0.1:{rsyncd.port}/ckpt/s{step}/"])
                peak, cpu, el = _sample([proc.pid, rsyncd.proc.pid], lambda: not pid_alive(proc.pid), 300)
                # The client's CPU from the kernel (it has exited). Not ru_maxrss: a forked child inherits its
                # parent's high-water mark (this process holds the state), so its peak RSS is the sampled one.
                _, status, ru = os.wait4(proc.pid, 0)
                proc.returncode = os.waitstatus_to_exitcode(status)
                cpu[0] = ru.ru_utime + ru.ru_stime
                shutil.rmtree(rsync_dest / f"s{step}", ignore_errors=True)
            rep[kind].append((peak[0], cpu[0] / (size / 1e9), peak[1], cpu[1] / (size / 1e9), el))
            shutil.rmtree(staging, ignore_errors=True)
        del state

        def col(kind: str, data: dict, i: int) -> float | None:
            return median([x[i] for x in data[kind]])

        base_idle = "idle `rsync --daemon` (C, no TLS/auth/watcher)"
        rows = [
            Row("daemon idle RSS vs idle rsync --daemon", col("rlsup", idle, 0), col("rsync", idle, 0), "MB",
                f"{base_idle}; rlsup: Python, aiohttp, watchdog, prometheus-client (no torch: trainer_hooks loads it lazily)"),
            Row("daemon idle CPU vs idle rsync --daemon", col("rlsup", idle, 1), col("rsync", idle, 1), "%",
                f"{window:.0f} s windows; rlsup polls its loops"),
            Row(f"replicating {size / 1e9:.1f} GB: sender peak RSS vs rsync client", col("rlsup", rep, 0),
                col("rsync", rep, 0), "MB", "rlsup daemon (node 0) vs the `rsync` client pushing the same step"),
            Row(f"replicating {size / 1e9:.1f} GB: sender CPU vs rsync client", col("rlsup", rep, 1),
                col("rsync", rep, 1), "s/GB", "rlsup: HMAC per file, sendfile, no hashing (the receiver checks the manifest's xxh3)"),
            Row(f"replicating {size / 1e9:.1f} GB: receiver peak RSS vs rsync daemon", col("rlsup", rep, 2),
                col("rsync", rep, 2), "MB", "rlsup daemon (node 1) vs rsync daemon + its forked receiver"),
            Row(f"replicating {size / 1e9:.1f} GB: receiver CPU vs rsync daemon", col("rlsup", rep, 3),
                col("rsync", rep, 3), "s/GB", "rlsup: body read straight off the socket into 8 MiB buffers, xxh3 of every byte, "
                "fsync, rename"),
        ]
        if rsyncd is None:  # the rows stay, baseline n/a, and say why
            rows = [dataclasses.replace(r, note=f"{r.note}; baseline: {br.RSYNC_MISSING}") for r in rows]
        return rows
    finally:
        for p in daemons:
            p.send_signal(signal.SIGTERM)
        for p in daemons:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        if rsyncd is not None:
            rsyncd.stop()
        shutil.rmtree(d, ignore_errors=True)


def _settled_cpu(pid: int, quiet_s: float = 0.6, timeout: float = 120) -> float:
    """The CPU seconds of ``pid``'s tree once it stopped growing for ``quiet_s`` (every process waits)."""
    last, since, t0 = _cpu_s(pid), time.monotonic(), time.monotonic()
    while time.monotonic() - t0 < timeout:
        time.sleep(0.1)
        now = _cpu_s(pid)
        if now - last > 0.01:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def bench_warm_fork(ctx: Ctx) -> list[Row]:
    """Arming the warm launcher of a 2-rank torchrun job: its warm ranks forked from it (``warm_fork``, the
    default) against spawned (each imports torch itself), alternating; CPU until every process waits, and
    the memory the waiting ranks hold of their own (USS) and in all (PSS, shared pages split)."""
    import psutil

    from supervisor.launch.warm_launcher import Zygote, warm_spec

    d = ctx.fresh("warm_fork")
    (d / "t.py").write_text("print('never run')\n")
    env = {k: v for k, v in job_env().items() if k != "OMP_NUM_THREADS"}  # a user's: torchrun adds it for 2 ranks
    spec = warm_spec([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(d / "t.py")], env, str(d))
    if spec is None:
        return [Row("warm ranks forked vs spawned: failed", None, None, "", "torchrun not found")]
    got: dict[str, list[tuple[float, float, float]]] = {"fork": [], "spawn": []}
    for _, side in alternate(max(2, ctx.reps), ["fork", "spawn"]):
        zygote = Zygote(spec, env, cwd=str(d), warm_fork=side == "fork")
        try:
            if not zygote.wait_ready(120):
                raise RuntimeError(f"the warm launcher did not get ready ({zygote.output_left[-500:]})")
            cpu = _settled_cpu(zygote.pid)
            uss = pss = 0.0
            for pid in zygote.warm_pids:
                with contextlib.suppress(psutil.Error):
                    m = psutil.Process(pid).memory_full_info()
                    uss, pss = uss + m.uss / 2**20, pss + m.pss / 2**20
            got[side].append((cpu, uss, pss))
        finally:
            zygote.discard()

    def col(side: str, i: int) -> float | None:
        return median([x[i] for x in got[side]])

    # the first attempt of a whole run: from a launcher spawned for it (warm_first_attempt) against torchrun's cold
    # start; the job imports torch and builds an optimizer (which imports torch._dynamo) on 2 ranks, then exits
    (d / "first.py").write_text("import torch\ntorch.optim.AdamW(torch.nn.Linear(4, 4).parameters())\n")
    first: dict[str, list[tuple[float, float]]] = {"warm": [], "cold": []}
    for _, side in alternate(max(2, ctx.reps), ["warm", "cold"]):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        r = subprocess.run([PY, "-m", "supervisor.cli.main", "run", "--max-restarts", "0", "--warm-first-attempt",
                            "true" if side == "warm" else "false", "--state-dir", str(d / f"state-{side}"), "--",
                            str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(d / "first.py")],
                           cwd=d, env=env, capture_output=True, text=True, timeout=300)
        wall = time.monotonic() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if r.returncode != 0:
            raise RuntimeError(f"rlsup run failed: {r.stderr[-800:]}")
        first[side].append((wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime))
        shutil.rmtree(d / f"state-{side}", ignore_errors=True)

    def fcol(side: str, i: int) -> float | None:
        return median([x[i] for x in first[side]])

    return [
        Row("a 2-rank run's first attempt: wall, launcher spawned for it vs torchrun cold", fcol("warm", 0),
            fcol("cold", 0), "s", "rlsup run --max-restarts 0 to its exit: torch imported, an optimizer built, on 2 ranks"),
        Row("a 2-rank run's first attempt: CPU, launcher spawned for it vs torchrun cold", fcol("warm", 1),
            fcol("cold", 1), "s", "rlsup and everything it started"),
        Row("arming a 2-rank warm launcher: CPU, ranks forked vs spawned", col("fork", 0), col("spawn", 0), "s",
            "the launcher (torchrun and torch._dynamo imported) and 2 warm ranks, until all wait"),
        Row("2 waiting warm ranks: memory of their own (USS), forked vs spawned", col("fork", 1), col("spawn", 1),
            "MB", "a fork shares the launcher's pages until it writes them"),
        Row("2 waiting warm ranks: PSS, forked vs spawned", col("fork", 2), col("spawn", 2), "MB",
            "shared pages split among the processes that map them"),
    ]


# ------------------------------------------------------------------------------------------ 7. goodput


def goodput_of(evs: list[dict], t0: float, t_end: float, killed: set[int]) -> tuple[float, int, int, int]:
    """(productive step seconds, final step, attempts that started, failed restarts: attempts that never
    trained although nobody killed them, the last one excepted).

    Rank 0's steps are kept unless a later attempt resumed from an earlier step (the work was redone);
    the productive time is the sum of the kept steps' durations that ended inside the window."""
    kept: list[tuple[int, float, float]] = []  # (step, t, dur)
    by_attempt: dict[int, list[dict]] = {}
    for e in evs:
        if e["rank"] == 0 and e["t"] <= t_end:
            by_attempt.setdefault(e["attempt"], []).append(e)
    started = {e["attempt"] for e in evs if e["ev"] == "start" and e["t"] <= t_end}
    trained = {a for a, es in by_attempt.items() if any(e["ev"] == "step" for e in es)}
    for a in sorted(by_attempt):
        for e in sorted(by_attempt[a], key=lambda e: e["t"]):
            if e["ev"] == "resumed":
                kept = [k for k in kept if k[0] <= e["step"]]
            elif e["ev"] == "step":
                kept.append((e["step"], e["t"], e["dur"]))
    productive = sum(dur for _, t, dur in kept if t0 <= t <= t_end)
    last_attempt = max(started) if started else -1
    never = len([a for a in started if a not in trained and a not in killed and a != last_attempt])
    return productive, (kept[-1][0] if kept else 0), len(started), never


def redone_per_crash(evs: list[dict]) -> float | None:
    """Steps trained again after each restart, averaged: rank 0's last step in an attempt minus the step
    the next attempt resumed from."""
    last: dict[int, int] = {}
    resumed: dict[int, int] = {}
    for e in evs:
        if e["rank"] == 0 and e["ev"] == "step":
            last[e["attempt"]] = max(last.get(e["attempt"], 0), e["step"])
        elif e["rank"] == 0 and e["ev"] == "resumed":
            resumed[e["attempt"]] = e["step"]
    redone = [last[a - 1] - step for a, step in resumed.items() if a > 0 and a - 1 in last]
    return sum(redone) / len(redone) if redone else None


@dataclass(frozen=True)
class GoodputSide:
    """One side of a goodput comparison: the launcher, how often the trainer saves, rlsup's extra flags."""

    launcher: str
    checkpoint_every: int
    extra: tuple[str, ...] = ()
    trainer: tuple[str, ...] = ()


def goodput_sides() -> dict[str, GoodputSide]:
    sides = {"rlsup": GoodputSide("rlsup", 10), "torchrun": GoodputSide("torchrun", 10)}
    if nvrx_missing() is None:
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        # The same trainer on both sides, saving asynchronously (what a trainer that saves often does).
        sides["rlsup+memory"] = GoodputSide("rlsup", 1, ("--memory-dir", str(shm / f"rlsup-bench-{os.getpid()}"),
                                                         "--disk-every", "20"), ("--async-save",))
        sides["ft"] = GoodputSide("ft", 10, (), ("--async-save",))
    return sides


def goodput_trial(ctx: Ctx, name: str, side: GoodputSide, window: float, every: float) -> tuple:
    """One run under SIGKILLs of rank 1 every ``every`` s: (goodput, last step, attempts, failed restarts,
    kills, steps redone per crash)."""
    d = ctx.fresh(f"goodput-{name.replace('+', '-')}")
    t0 = time.monotonic()
    proc = launch(side.launcher, d, ["--checkpoint-every", str(side.checkpoint_every), "--step-time", "0.02",
                                     *side.trainer],
                  max_restarts=100, extra=list(side.extra))
    kills = 0
    killed: set[int] = set()
    t_end, next_kill = t0 + window, t0 + every
    while time.monotonic() < t_end:
        time.sleep(0.05)
        if time.monotonic() >= next_kill:
            next_kill += every
            starts = [e for e in events(d) if e["ev"] == "start" and e["rank"] == 1]
            if starts:
                victim = max(starts, key=lambda e: (e["attempt"], e["t"]))
                if pid_alive(victim["pid"]):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(victim["pid"], signal.SIGKILL)
                        kills += 1
                        killed.add(victim["attempt"])
    evs = events(d)
    stop(proc)
    productive, last_step, attempts, never = goodput_of(evs, t0, t_end, killed)
    redone = redone_per_crash(evs)
    log(f"goodput {name}: {productive / window:.3f} (step {last_step}, {attempts} attempts, {never} failed "
        f"restarts, {kills} kills, {fmt(redone)} steps redone per crash)")
    for extra in side.extra:
        if extra.startswith("/dev/shm/") or "rlsup-bench-" in extra:
            shutil.rmtree(extra, ignore_errors=True)
    shutil.rmtree(d, ignore_errors=True)
    return productive / window, last_step, attempts, never, kills, redone


def bench_goodput(ctx: Ctx) -> list[Row]:
    window = 25.0 if ctx.quick else 60.0
    every = 10.0 if ctx.quick else 15.0
    reps = 1 if ctx.quick else 2
    sides = goodput_sides()
    res: dict[str, list[tuple]] = {k: [] for k in sides}
    for _, name in alternate(reps, list(sides)):
        res[name].append(goodput_trial(ctx, name, sides[name], window, every))

    def summary(name: str) -> str:
        xs = res[name]
        redone = [x[5] for x in xs if x[5] is not None]
        return (f"{name}: steps {'/'.join(str(x[1]) for x in xs)}, kills {sum(x[4] for x in xs)}, "
                f"failed restarts {sum(x[3] for x in xs)}, redone per crash {fmt(median(redone))}")

    def good(name: str) -> float | None:
        return median([x[0] for x in res[name]])

    rows = [Row(f"goodput, SIGKILL every {every:.0f} s over {window:.0f} s, vs torchrun --max-restarts 100",
                good("rlsup"), good("torchrun"), "frac",
                f"productive step time / wall, both save to disk every 10 steps; {summary('rlsup')}; "
                f"{summary('torchrun')}")]
    if "ft" in sides:
        rows.append(Row(f"goodput, SIGKILL every {every:.0f} s over {window:.0f} s: rlsup memory tier (save every "
                        f"step, disk every 20) vs ft_launcher (disk every 10), async saves", good("rlsup+memory"),
                        good("ft"),
                        "frac", f"{summary('rlsup+memory')}; {summary('ft')}"))
    else:
        rows.append(Row("goodput: rlsup memory tier vs ft_launcher", None, None, "frac", f"n/a: {nvrx_missing()}"))
    return rows


# ------------------------------------------------------------------------------------------ gpu_check


def bench_gpu_check(ctx: Ctx) -> list[Row]:
    """``pre_launch_check: builtin`` (NVML in process) vs a command check (a shell, as every site check
    runs): ``nvidia-smi`` where it exists, else ``true``, the floor of any command. On a CPU node the
    builtin takes its "no GPUs: skipped" path."""
    from supervisor.diagnosis.gpu_health import check_gpus
    from supervisor.run.node_health import run_check

    calls = 20 if ctx.quick else 100
    command = "nvidia-smi" if shutil.which("nvidia-smi") else "true"
    launch = ["torchrun", "--nproc-per-node", "1", "train.py"]
    builtin, shell, detail = [], [], ""
    for i in range(calls):  # alternating, as every figure here
        for side in (("builtin", "shell") if i % 2 == 0 else ("shell", "builtin")):
            t0 = time.perf_counter()
            if side == "builtin":
                detail = check_gpus(launch).detail
                builtin.append(time.perf_counter() - t0)
            else:
                run_check(command, 60)
                shell.append(time.perf_counter() - t0)
    return [Row(f"pre_launch_check builtin vs '{command}' as a command check", median(builtin) * 1e3,
                median(shell) * 1e3, "ms", f"{calls} calls each, alternating, median; builtin said: {detail}")]


# ------------------------------------------------------------------------------------------ flight_recorder


def bench_flight_recorder(ctx: Ctx) -> list[Row]:
    """What rlsup's default ``TORCH_FR_BUFFER_SIZE=2000`` costs a job: a tight loop of small gloo
    all-reduces (2 ranks, 4 floats: the collective at its cheapest, so FR's per-call bookkeeping shows
    most) with FR on (and rlsup's FR thread waiting) vs off, one torchrun per side (torch reads the
    variable once per process), sides alternating; then one dump of a full ring, and rlsup's verdict on
    the four recorded dumps of tests/data (torch's analyser in its child process, torch import included)."""
    from supervisor.diagnosis.flight_recorder import analyse, read_dump

    job = BENCH / "jobs" / "bench_fr_collectives.py"
    blocks, per_block = (5, 1000) if ctx.quick else (9, 2000)
    on: list[float] = []
    off: list[float] = []
    dumps: list[dict] = []
    for i in range(ctx.reps * 2):
        for side in (("on", "off") if i % 2 == 0 else ("off", "on")):
            d = ctx.fresh(f"fr-{side}")
            env = {**job_env(), "TORCH_FR_BUFFER_SIZE": "2000" if side == "on" else "0"}
            r = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(job), str(blocks),
                                str(per_block), str(d)], env=env, capture_output=True, text=True, timeout=600)
            line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"{side}: exit {r.returncode}: {r.stderr[-500:]}")
            res = json.loads(line[len("RESULT "):])
            (on if side == "on" else off).append(res["us"])
            if side == "on":
                dumps.append(res)
    data = ROOT / "tests" / "data" / "flight_recorder" / "broadcast_instead"
    recorded = {r: read_dump(data / f"rank_{r:05d}.fr.json") or {} for r in range(4)}
    verdict_s = []
    for _ in range(3 if ctx.quick else 5):
        t0 = time.perf_counter()
        analyse(recorded, in_child=True)
        verdict_s.append(time.perf_counter() - t0)
    last = dumps[-1]
    return [
        Row("gloo all_reduce (2 ranks, 4 floats) with FR on (2000 entries, rlsup's FR thread waiting) vs off",
            median(on), median(off), "us", f"{len(on)} torchrun runs per side, alternating, each the median of "
            f"{blocks} blocks of {per_block} calls; per-run medians on {[round(x, 1) for x in on]} off "
            f"{[round(x, 1) for x in off]}"),
        Row("one FR dump of a full ring (_dump_fr_trace_json, in the rank)", median([x["dump_ms"] for x in dumps]),
            None, "ms", f"{last['entries']} entries, {last['dump_bytes']} bytes of JSON"),
        Row("rlsup's verdict on 4 recorded dumps (torch's analyser in a child process)", median(verdict_s) * 1e3,
            None, "ms", f"{len(verdict_s)} runs, median; most of it the child's torch import"),
    ]


# ------------------------------------------------------------------------------------------ recovery


def bench_recovery(ctx: Ctx) -> list[Row]:
    """Realistic recovery (issue 31): benchmarks/bench_recovery.py, ``--recovery-minutes`` per side, one
    repetition unless ``--reps`` says; only with ``--only recovery`` (15 min and more)."""
    import bench_recovery

    figs = bench_recovery.run(ctx.work, ctx.recovery_minutes, reps=ctx.recovery_reps)
    return [Row(f.name, f.rlsup, f.base, f.unit, f.note) for f in figs]


def bench_node_loss(ctx: Ctx) -> list[Row]:
    """Node loss (issue 31): benchmarks/bench_node_loss.py, a spare against a replacement after 30 s and at once,
    2 repetitions per side unless ``--reps`` says; only with ``--only node_loss`` (about 18 min)."""
    import bench_node_loss

    figs = bench_node_loss.run(ctx.work, reps=ctx.node_loss_reps)
    return [Row(f.name, f.rlsup, f.base, f.unit, f.note) for f in figs]


def bench_overhead(ctx: Ctx) -> list[Row]:
    """No faults (issue 41): the same trainer and save cadence under bare torchrun, rlsup's defaults and rlsup's
    memory tier, sides alternating (benchmarks/bench_overhead.py); only with ``--only overhead`` (about 12 min full,
    4 min quick)."""
    import bench_overhead

    s = bench_overhead.Settings(reps=ctx.reps, **({"steps": 120, "skip": 40} if ctx.quick else {}))
    figs, _ = bench_overhead.run(ctx.work, s)
    return [Row(f.name, f.rlsup, f.base, f.unit, f.note) for f in figs]


def bench_shrink(ctx: Ctx) -> list[Row]:
    """Shrink (issue 43): 3 nodes x 1 rank, 100 MB per node; node 2 lost with no spare left, the job going on with 2
    (``--min-nodes 2``), against a spare taking its rank, sides alternating (benchmarks/bench_shrink.py); 1 trial per
    side quick (about 3 min), 2 full (about 9 min), node 0 lost (etcd) as a third side, ``--reps`` overrides; only with ``--only shrink``."""
    import bench_shrink

    st = bench_shrink.QUICK if ctx.quick else bench_shrink.Settings()
    figs = bench_shrink.run(ctx.work, reps=ctx.shrink_reps, st=st)
    return [Row(f.name, f.rlsup, f.base, f.unit, f.note) for f in figs]


def bench_watch_cpu(ctx: Ctx) -> list[Row]:
    """What watching a job costs: rlsup run's own CPU against torchrun's agent's (benchmarks/bench_watch_cpu.py)."""
    import bench_watch_cpu

    sides = {w.side: w for w in bench_watch_cpu.measure(ctx.reps, 10.0 if ctx.quick else 20.0)}
    return [Row("watching a sleeping 2-rank job: the watcher's own CPU", 100 * sides["rlsup"].median,
                100 * sides["torchrun"].median, "% of a core", "rlsup run vs torchrun's agent, same job")]


def bench_writer_start(ctx: Ctx) -> list[Row]:
    """An attempt's first async saves: the writer started with the manager vs on the first save (the way before),
    fresh rank processes, sides alternating (benchmarks/bench_writer_start.py)."""
    import bench_writer_start

    figs = bench_writer_start.run(64 if ctx.quick else 256, ctx.reps * 2)
    new, old = figs["prestart"], figs["lazy"]
    note = "writer started with the manager vs on the first save; steps of 0.5 s"
    return [Row("an attempt's second async save: blocked", new["blocked_2"], old["blocked_2"], "s", note),
            Row("an attempt's first step valid in memory after its save call", new["valid_1"], old["valid_1"], "s",
                note),
            Row("manager built -> third save returned (restore, 3 steps)", new["third_save_returned"],
                old["third_save_returned"], "s", note)]


# ------------------------------------------------------------------------------------------ main


BENCHES: dict[str, Callable[[Ctx], list[Row]]] = {
    "restart": bench_restart, "hang": bench_hang, "hang_restart": bench_hang_restart, "save": bench_save, "heartbeat": bench_heartbeat,
    "selection": bench_selection, "replication": bench_replication, "restore": bench_restore,
    "footprint": bench_footprint, "goodput": bench_goodput, "gpu_check": bench_gpu_check,
    "flight_recorder": bench_flight_recorder, "recovery": bench_recovery, "node_loss": bench_node_loss,
    "watch_cpu": bench_watch_cpu, "writer_start": bench_writer_start, "overhead": bench_overhead,
    "shrink": bench_shrink, "warm_fork": bench_warm_fork,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, fewer repetitions: < 5 min on 2 cores")
    ap.add_argument("--only", default="", help=f"comma-separated subset of: {','.join(FIGURES)}; and recovery "
                    "(issue 31's realistic recovery harness, never in the default set: 15 min and more) and "
                    "node_loss (its node-loss variant, never in the default set: about 18 min) and overhead (no "
                    "faults: rlsup's price against bare torchrun, never in the default set: about 12 min) and shrink (issue "
                    "43: a shrink to 2 of 3 nodes against a spare's takeover, never in the default set: about 3 min "
                    "quick, 6 full)")
    ap.add_argument("--recovery-minutes", type=float, default=5.0, help="recovery: wall window per side")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per side (default: 2 quick, 5 full)")
    ap.add_argument("--layouts", default="", help=f"selection layouts, comma-separated: {','.join(LAYOUT_KEYS)}")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir; needs ~5 GB full)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("--markdown", default=None, help="also write the rows as a Markdown table here (BENCHMARKS.md)")
    args = ap.parse_args()
    only = [x.strip() for x in args.only.split(",") if x.strip()] or list(FIGURES)
    unknown = [x for x in only if x not in BENCHES]
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()] or None
    bad_layouts = [x for x in layouts or [] if x not in LAYOUT_KEYS]
    if unknown or bad_layouts:
        ap.error(f"unknown figure(s) {unknown} or layout(s) {bad_layouts}")
    work = Path(tempfile.mkdtemp(prefix="rlsup-bench-run-", dir=args.dir))
    ctx = Ctx(args.quick, args.reps or (2 if args.quick else 5), work, layouts, args.recovery_minutes,
              args.reps or 1, args.reps or 2, args.reps or (1 if args.quick else 2))
    import platform

    print(f"rlsup benchmarks ({'quick' if args.quick else 'full'}): {os.cpu_count()} cores, "
          f"{platform.platform()}, python {platform.python_version()}, reps {ctx.reps}", flush=True)
    print(HEADER, flush=True)
    all_rows: list[Row] = []
    started = time.monotonic()
    try:
        for key in only:
            t0 = time.monotonic()
            try:
                rows = BENCHES[key](ctx)
            except Exception as e:  # one broken figure must not hide the others
                rows = [Row(f"{key}: failed", None, None, "", f"{type(e).__name__}: {e}")]
            for row in rows:
                print_row(row)
            all_rows += rows
            log(f"{key}: {time.monotonic() - t0:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"total {time.monotonic() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps([{**r.__dict__, "ratio": r.ratio} for r in all_rows], indent=1))
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(all_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
