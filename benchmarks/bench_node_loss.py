"""Realistic recovery, node loss (issue 31): a spare node against waiting for a replacement node.

    .venv/bin/python benchmarks/bench_node_loss.py                        # 3 sides x 2, alternating (~18 min)
    .venv/bin/python benchmarks/bench_node_loss.py --sides spare,replace --reps 1   # quick (~6 min)
    .venv/bin/python benchmarks/bench_node_loss.py --sides spare,replace0 --replace-delay 30 --keep /tmp/nl
    .venv/bin/python benchmarks/run.py --only node_loss --reps 2         # the same, as run.py's table rows

A trial takes about 3 minutes on 2 loaded cores: the job's start (~40 s), ``--warm`` (25 s), ``--post`` (90 s)
and the teardown. Results and method: BENCHMARKS.md, "Node loss: a spare against a replacement".

Job: 3 nodes x 2 ranks on 127.0.0.1, each node its own ``rlsup run`` in its own working directory, peers
listing every node, torchrun typed as users type it (c10d, ``--nnodes 3``). The trainer is
benchmarks/jobs/recovery_trainer.py (an MLP, SGD with momentum, real compute and a gloo all-reduce per step),
``--width 1536``: 37.8 MB of state per rank, 75.5 MB per node; it saves every step (trainer_hooks), and rlsup
replicates every node's parts to the next node (the default ``replication_factor`` 1). rlsup's defaults
otherwise (``spare_takeover_s`` 3 s, warm launcher on), ``--max-restarts 100``.

Once the job has trained ``--warm`` seconds, node 2's rlsup and its whole process tree (torchrun, ranks,
warm launcher, guard) are SIGKILLed at once and its directory removed. Then, for ``--post`` seconds:

    spare        a 4th rlsup (``--spares 1``) was started with the job; it takes node rank 2 after the default
                 ``spare_takeover_s`` and fetches node 2's parts from node 0 (their replica holder)
    replace      no spare; a replacement rlsup with ``--node-rank 2`` is started in a fresh, empty directory
                 ``--replace-delay`` seconds after the loss (a scheduler giving a node back; 30 s by default:
                 a node already allocated and booted, so the queue wait is zero, which is the best case a
                 scheduler offers; a requeue costs minutes to hours)
    replace0     the same, the replacement started at once (0 s): the best case of any replacement

Figures per trial (benchmarks/node_loss_accounting.py): the SIGKILL -> the first step of the next attempt on
every node (and its phases, from the events and the rlsup logs), the steps redone (and node 2's newest step
whose every part node 0 held at the loss: what the next attempt can resume from), and the goodput (useful step
time / wall) over ``[loss - --pre, loss + --post]``.
Sides alternate (A B C, C B A, ...). Every node's directory is removed when its trial ends and every process of
the trial is SIGKILLed; ``--keep DIR`` keeps the events and the rlsup logs of the surviving nodes (small).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Iterator

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

from jobctl import PY, Figure, alternating_trials, events, job_env, log, pid_alive, print_figures  # noqa: E402
from rlsup_format.manifest import list_step_dirs  # noqa: E402
from rlsup_format.names import manifest_name  # noqa: E402
from node_loss_accounting import LossFigures, loss_figures  # noqa: E402

TRAINER = BENCH / "jobs" / "recovery_trainer.py"
NODES = 3
RANKS_PER_NODE = 2
LOST = 2
WIDTH = 1536  # 2 x 1536^2 weights + momentum: 37.8 MB per rank (1768: 50 MB, 100 MB per node)


def state_mb_per_node(width: int) -> float:
    """The trainer's state (weights and momentum, fp32) of a node's ranks at ``width``."""
    return RANKS_PER_NODE * (2 * width * width + 2 * width + 1 + width + 1) * 2 * 4 / 1e6


@dataclass(frozen=True)
class Side:
    """One way to get node rank 2 back: a spare started with the job, or a replacement after a delay."""

    name: str
    spares: int
    replace_after: float | None  # seconds after the loss (None: no replacement)
    label: str


@dataclass(frozen=True)
class Settings:
    """What every trial shares."""

    warm: float = 25.0  # the job trains this long (from its first step) before the loss
    pre: float = 15.0  # the goodput window starts this long before the loss
    post: float = 90.0  # ... and ends this long after it (a replacement after 30 s needs about 60 s here)
    micro_batches: int = 1
    batch: int = 128
    width: int = WIDTH


@dataclass
class Trial:
    """One side's run: its figures, and what the rlsup logs and the harness saw (seconds after the loss)."""

    side: str
    load: float  # 1-minute load average at the trial's start
    figures: LossFigures | None
    marks: dict[str, float] = field(default_factory=dict)
    median_step_s: float | None = None
    replicated: int | None = None  # node 2's newest step whose parts node 0 held at the loss
    error: str = ""


def sides(delay: float) -> dict[str, Side]:
    return {"spare": Side("spare", 1, None, "spare (--spares 1, spare_takeover_s 3 s)"),
            "replace": Side("replace", 0, delay, f"replacement after {delay:g} s"),
            "replace0": Side("replace0", 0, 0.0, "replacement at once (0 s)")}


def free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclass(frozen=True)
class Launch:
    """What every node of a trial runs under its ``rlsup run``: the trainer (its ``--events`` and
    ``--checkpoint-dir`` are the trial's), its own arguments, ranks per node and rlsup's extra options. Node loss's
    is :func:`recovery_launch`; benchmarks/bench_shrink.py brings its own."""

    trainer: Path
    trainer_args: tuple[str, ...]
    ranks_per_node: int = RANKS_PER_NODE
    rlsup_args: tuple[str, ...] = ()
    rdzv_id: str = "nodeloss"


def recovery_launch(st: Settings) -> Launch:
    """Node loss's job: the realistic harness's trainer at the settings' size, 2 ranks per node, saving every step."""
    return Launch(TRAINER, ("--width", str(st.width), "--batch", str(st.batch), "--micro-batches",
                            str(st.micro_batches), "--checkpoint-every", "1"))


class Job:
    """The nodes of one trial: ``rlsup run`` processes on 127.0.0.1, each in its own directory under ``root``."""

    def __init__(self, root: Path, side: Side, st: Settings, launch: Launch | None = None) -> None:
        self.root, self.side, self.st = root, side, st
        self.launch = launch or recovery_launch(st)
        self.peers_n = NODES + side.spares
        *self.repl_ports, self.coord_port, self.master_port = free_ports(self.peers_n + 2)
        self.token = root / "token"
        self.token.write_text("node-loss-bench-secret\n")
        self.token.chmod(0o600)
        self.events = root / "events.jsonl"
        self.procs: dict[str, subprocess.Popen] = {}  # by directory name

    def cmd(self, node: int) -> list[str]:
        """``rlsup run`` of node rank ``node``, run in its directory: checkpoint_dir is the default
        ``checkpoints`` there, as written the same on every node (it names the job)."""
        peers = ",".join(f"127.0.0.1:{p}" for p in self.repl_ports)
        spares = ["--spares", str(self.side.spares)] if self.side.spares else []
        launch = self.launch
        torchrun = [PY, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node",
                    str(launch.ranks_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    f"127.0.0.1:{self.master_port}", "--rdzv-id", launch.rdzv_id]
        trainer = [str(launch.trainer), "--events", str(self.events), "--checkpoint-dir", "checkpoints",
                   *launch.trainer_args]
        return [PY, "-m", "supervisor.cli.main", "run", "--peers", peers, "--node-rank", str(node), *spares,
                "--coordinator-port", str(self.coord_port), "--token-file", str(self.token),
                "--max-restarts", "100", *launch.rlsup_args, "--", *torchrun, *trainer]

    def start(self, node: int, name: str) -> None:
        d = self.root / name
        d.mkdir()
        with open(d / "rlsup.log", "ab") as out:
            self.procs[name] = subprocess.Popen(self.cmd(node), cwd=d, env=job_env(), stdout=out,
                                                stderr=subprocess.STDOUT, start_new_session=True)

    def lose(self, name: str) -> float:
        """SIGKILL node ``name``'s rlsup and its whole process tree at once, remove its directory; the
        ``time.monotonic()`` of the SIGKILL."""
        proc = self.procs.pop(name)
        tree = process_tree(proc.pid)
        t = time.monotonic()
        kill_all(tree)
        proc.wait(30)
        stragglers = [p for p in tree if pid_alive(p)] + naming(str(self.root / name) + os.sep)
        kill_all(stragglers)
        deadline = time.monotonic() + 30
        while any(pid_alive(p) for p in tree + stragglers) and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.rmtree(self.root / name, ignore_errors=True)
        return t

    def stop(self) -> None:
        """SIGKILL every node's tree, then anything still naming the trial's directory."""
        pids = [p for proc in self.procs.values() for p in process_tree(proc.pid)]
        kill_all(pids)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            left = [p for p in pids if pid_alive(p)] + naming(str(self.root) + os.sep)
            if not left:
                return
            kill_all(left)
            time.sleep(0.2)
        log(f"node_loss: processes left after the trial: {left}")

    def replicated(self, owner: int, holder: str) -> int | None:
        """The newest step of node ``owner`` whose every part node ``holder`` holds as a replica."""
        per_node = self.launch.ranks_per_node
        ranks = range(owner * per_node, (owner + 1) * per_node)
        steps = [s for ns in (self.root / holder / "replicas").glob(f"*.node{owner}") for s, d in list_step_dirs(ns)
                 if all((d / manifest_name(r)).exists() for r in ranks)]
        return max(steps, default=None)

    def log_text(self, name: str) -> str:
        path = self.root / name / "rlsup.log"
        return path.read_text(errors="replace") if path.exists() else ""


def process_tree(pid: int) -> list[int]:
    import psutil

    try:
        return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return [pid]


def naming(marker: str) -> list[int]:
    """Pids of this user's processes with an argument containing ``marker`` (what is left of a node's job)."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if p.info["pid"] != os.getpid() and any(marker in a for a in p.info["cmdline"] or []):
                out.append(p.info["pid"])
    return out


def kill_all(pids: list[int]) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def logged_at(text: str, pattern: str, after: float) -> float | None:
    """The wall-clock time (epoch s) of the first rlsup log line matching ``pattern`` at or after ``after``."""
    for m in re.finditer(r"^(\S+Z) .*" + pattern, text, re.M):
        t = datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()
        if t >= after - 0.001:  # log stamps have a millisecond's resolution
            return t
    return None


@contextlib.contextmanager
def started_job(work: Path, prefix: str, side: Side, st: Settings, launch: Launch | None = None,
                keep: Path | None = None) -> Iterator[Job]:
    """A trial's job in a fresh directory under ``work``, every node (and the side's spares) started; on the way
    out every process of it SIGKILLed, its logs kept under ``keep`` (when given) and its directory removed."""
    root = Path(tempfile.mkdtemp(prefix=f"{prefix}-{side.name}-", dir=work))
    job = Job(root, side, st, launch)
    try:
        for node in range(NODES + side.spares):
            job.start(node, f"node{node}")
        yield job
    finally:
        job.stop()
        if keep is not None:
            save_logs(job, keep / root.name)
        shutil.rmtree(root, ignore_errors=True)


def wait_first_step(job: Job, deadline: float) -> float | None:
    """``time.monotonic()`` of rank 0's first step, or None when the job has not stepped by ``deadline``."""
    while time.monotonic() < deadline:
        steps = [e["t"] for e in events(job.root) if e["ev"] == "step" and e["rank"] == 0]
        if steps:
            return min(steps)
        if any(p.poll() is not None for p in job.procs.values()):
            return None
        time.sleep(0.2)
    return None


def trained_for(job: Job, warm: float) -> bool:
    """Wait for rank 0's first step (300 s at most), then for ``warm`` seconds of training from it; False when the
    job never stepped (a node ended first, or the 300 s ran out)."""
    first = wait_first_step(job, time.monotonic() + 300)
    if first is None:
        return False
    while time.monotonic() < first + warm:
        time.sleep(0.1)
    return True


def log_marks(job: Job, side: Side, kill_wall: float) -> dict[str, float]:
    """When (after the loss) the rlsup logs say the round went on: node 0's attempt ended, the spare took the
    rank or the replacement joined, the lost node's parts were fetched, node 2 launched."""
    node2 = "node3" if side.spares else "node2-replacement"
    marks = {"survivors' attempt ended": logged_at(job.log_text("node0"), r"attempt \d+ failed", kill_wall),
             "spare took the rank": logged_at(job.log_text(node2), "took node rank", kill_wall),
             "parts fetch began": logged_at(job.log_text(node2), r"attempt \d+: fetching ranks", kill_wall),
             "node 2 launched": logged_at(job.log_text(node2), r"attempt \d+: launching", kill_wall)}
    return {k: v - kill_wall for k, v in marks.items() if v is not None}


def trial(work: Path, side: Side, st: Settings, keep: Path | None) -> Trial:
    """Start the job (and the spare), lose node 2 once it has trained ``st.warm`` s, bring rank 2 back the
    side's way, and account the ``[loss - pre, loss + post]`` window."""
    load = os.getloadavg()[0]
    marks: dict[str, float] = {}
    with started_job(work, "nodeloss", side, st, keep=keep) as job:
        if not trained_for(job, st.warm):
            return Trial(side.name, load, None, error=f"no first step: {tail(job)}")
        replicated = job.replicated(LOST, "node0")  # node 0 holds node 2's replicas (the ring, factor 1)
        kill_wall = time.time()
        kill_t = job.lose(f"node{LOST}")
        if side.replace_after is not None:
            while time.monotonic() < kill_t + side.replace_after:
                time.sleep(0.05)
            marks["replacement started"] = time.monotonic() - kill_t
            job.start(LOST, "node2-replacement")
        while time.monotonic() < kill_t + st.post + 1.0:
            time.sleep(0.2)
        evs = events(job.root)
        marks.update(log_marks(job, side, kill_wall))
        steps = [e["dur"] for e in evs if e["ev"] == "step" and e["rank"] == 0 and e["t"] <= kill_t]
        figs = loss_figures(evs, kill_t, NODES, RANKS_PER_NODE, st.pre, st.post)
        return Trial(side.name, load, figs, marks, statistics.median(steps) if steps else None, replicated)


def tail(job: Job) -> str:
    lines = [ln for name in job.procs for ln in job.log_text(name).splitlines() if "rror" in ln or "[rlsup]" in ln]
    return " / ".join(lines[-6:])


def save_logs(job: Job, dest: Path) -> None:
    """The trial's events and the rlsup log of every node whose directory is left (the lost node's went with it)."""
    dest.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        shutil.copy(job.events, dest / "events.jsonl")
    for path in sorted(job.root.glob("*/rlsup.log")):
        with contextlib.suppress(OSError):
            shutil.copy(path, dest / f"{path.parent.name}.log")


def med(xs: list[float | None]) -> float | None:
    ys = [x for x in xs if x is not None]
    return statistics.median(ys) if ys else None


def fmt(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def loss_text(f: LossFigures, replicated: int | None) -> str:
    """A trial's way back as its log line says it: the loss -> first step and its phases, the steps redone."""
    return (f"loss -> first step {fmt(f.first_step)} s (nodes started {'/'.join(fmt(x) for x in f.nodes_started)}, "
            f"rendezvous {fmt(f.rendezvous)}, restored {fmt(f.restored)}); reached {f.reached} (node 2's newest "
            f"replicated {replicated}) resumed {f.resumed} redone {f.redone}")


def marks_text(marks: dict[str, float]) -> str:
    """What the rlsup logs said, in the order it came."""
    return ", ".join(f"{k} +{v:.1f}" for k, v in sorted(marks.items(), key=lambda kv: kv[1]))


def describe(t: Trial) -> str:
    """One trial as a log line."""
    if t.figures is None:
        return f"{t.side}: failed ({t.error})"
    f = t.figures
    return (f"{t.side}: load {t.load:.1f}; {loss_text(f, t.replicated)}; goodput {f.goodput:.3f} (before the loss "
            f"{f.steady_goodput:.3f}); step {t.median_step_s or 0:.3f} s; log: {marks_text(t.marks)}")


def figures(res: dict[str, list[Trial]], all_sides: dict[str, Side], st: Settings) -> list[Figure]:
    """The spare's medians against each replacement side's."""
    def m(name: str, get: object) -> float | None:
        return med([get(t.figures) for t in res.get(name, []) if t.figures is not None])  # type: ignore[operator]

    head = (f"3 nodes x 2 ranks + c10d, {state_mb_per_node(st.width):.0f} MB/node saved every step and replicated, "
            f"window {st.pre:g} s before + {st.post:g} s after the loss")
    rows = []
    for base in (k for k in res if k != "spare"):
        vs = f"spare vs {all_sides[base].label}"
        note = " | ".join(describe(t) for t in res.get("spare", []) + res[base])
        rows += [Figure(f"node loss -> first step of the next attempt on every node ({vs})",
                        m("spare", lambda f: f.first_step), m(base, lambda f: f.first_step), "s", note),
                 Figure(f"node loss: steps redone ({vs})", m("spare", lambda f: f.redone),
                        m(base, lambda f: f.redone), "steps"),
                 Figure(f"node loss: goodput ({head}; {vs})", m("spare", lambda f: f.goodput),
                        m(base, lambda f: f.goodput), "frac")]
    return rows


def run(work: Path, reps: int = 2, names: tuple[str, ...] = ("spare", "replace", "replace0"),
        delay: float = 30.0, st: Settings = Settings(), keep: Path | None = None) -> list[Figure]:
    """Every side in ``names`` ``reps`` times, alternating; the table's rows."""
    all_sides = sides(delay)
    unknown = [n for n in names if n not in all_sides]
    if unknown:
        raise ValueError(f"unknown side(s) {unknown}: choose from {list(all_sides)}")
    log(f"node_loss: {state_mb_per_node(st.width):.1f} MB of state per node, sides {list(names)}, {reps} rep(s), {st}")
    res = alternating_trials(reps, names, lambda name: trial(work, all_sides[name], st, keep),
                             lambda t: f"node_loss {describe(t)}")
    return figures(res, all_sides, st)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2, help="repetitions per side (sides alternate)")
    ap.add_argument("--sides", default="spare,replace,replace0", help="a subset of spare,replace,replace0")
    ap.add_argument("--replace-delay", type=float, default=30.0, help="replace: seconds from the loss to the "
                    "replacement's start (a scheduler giving a node back)")
    ap.add_argument("--warm", type=float, default=Settings.warm, help="seconds of training before the loss")
    ap.add_argument("--pre", type=float, default=Settings.pre, help="goodput window: seconds before the loss")
    ap.add_argument("--post", type=float, default=Settings.post, help="goodput window: seconds after the loss")
    ap.add_argument("--micro-batches", type=int, default=Settings.micro_batches, help="the trainer's step size")
    ap.add_argument("--width", type=int, default=WIDTH, help="the trainer's width (state per node: "
                    f"{state_mb_per_node(WIDTH):.1f} MB at {WIDTH}, 100 MB at 1768)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--keep", default=None, help="keep the events and the surviving nodes' rlsup logs here")
    args = ap.parse_args()
    if args.pre > args.warm:
        ap.error("--pre must not exceed --warm (the window would start before the job ran)")
    st = Settings(args.warm, args.pre, args.post, args.micro_batches, width=args.width)
    return print_figures("rlsup-node-loss-", args.dir, lambda work: run(
        work, args.reps, tuple(x for x in args.sides.split(",") if x), args.replace_delay, st,
        Path(args.keep) if args.keep else None))


if __name__ == "__main__":
    sys.exit(main())
