"""Shrink (issue 43): a node lost with no spare left, the job going on with the 2 nodes it has, against a spare
taking the lost node's rank (the node-loss harness's "spare", benchmarks/bench_node_loss.py), in the same run.

    .venv/bin/python benchmarks/run.py --quick --only shrink        # 1 trial per side (~3 min on 2 cores)
    .venv/bin/python benchmarks/run.py --only shrink                # 2 trials per side, alternating (~6 min)
    .venv/bin/python benchmarks/bench_shrink.py --reps 1 --keep /tmp/shrink

Job: 3 nodes x 1 rank on 127.0.0.1, each node its own ``rlsup run`` in its own working directory (the node-loss
harness's :class:`~bench_node_loss.Job`), torchrun typed as users type it (c10d, ``--nnodes 3``), ``--min-nodes 2``
on every node of both sides, rlsup's defaults otherwise (``spare_takeover_s`` 3 s, warm launcher on,
``replication_factor`` 1: node 2's parts go to node 0). The trainer is benchmarks/jobs/shrink_trainer.py: DDP over
gloo, 100 MB of state per rank (width 2500), saved every step through trainer_hooks' torch backend, resizable (a
ResumableSampler, the global batch kept by gradient accumulation).

    spare    a 4th rlsup (``--spares 1``) started with the job takes node rank 2 and fetches node 2's part from
             node 0; the job goes on with 3 nodes
    shrink   no spare: node 0 waits ``spare_takeover_s`` for node 2, then the job goes on with nodes 0 and 1
             ("continued on 2 of 3 nodes from step S"), each rank now taking 3 micro batches per step instead of 2
    shrink0  no spare, node 0 lost instead (the store is a 3-member etcd on 127.0.0.1, tests/etcd_cluster.py: the
             embedded one goes with node 0): node 1 or 2 claims the round's lead once node 0 is missing from it,
             and the job goes on with nodes 1 and 2, torchrun's master on node 1

Once the job has trained ``--warm`` seconds and a newer save of node 2 is replicated to node 0, node 2's rlsup and its
whole process tree are SIGKILLed at once and its directory removed (never replaced). Figures per trial
(benchmarks/node_loss_accounting.py, as the node-loss harness's): the SIGKILL -> rank 0's first step in a process
started after it (every step ends in DDP's all-reduce over every rank of the new world: the first step on every
node), its phases, the steps redone; and (benchmarks/shrink_accounting.py) rank 0's step time before the loss and
after it, over ``--post`` seconds from that first step. Sides alternate (spare, shrink, shrink0, shrink0, shrink,
spare, ...); ``shrink0`` only where etcd is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

from bench_node_loss import (NODES, Job, Launch, Side, fmt, logged_at, loss_text, marks_text, med,  # noqa: E402
                             started_job, tail, trained_for)
from bench_node_loss import Settings as NodeLossSettings  # noqa: E402
from jobctl import Figure, alternating_trials, events, log, print_figures  # noqa: E402
from node_loss_accounting import LossFigures, loss_figures  # noqa: E402
from shrink_accounting import median_or_none, step_durations  # noqa: E402

if TYPE_CHECKING:
    from etcd_cluster import EtcdCluster

TRAINER = BENCH / "jobs" / "shrink_trainer.py"
LOST = 2
MIN_NODES = 2
SIDES = {"spare": Side("spare", 1, None, "spare (--spares 1, spare_takeover_s 3 s)"),
         "shrink": Side("shrink", 0, None, "shrink to 2 of 3 (--min-nodes 2, no spare)"),
         "shrink0": Side("shrink0", 0, None, "shrink to 2 of 3 without node 0 (--min-nodes 2, etcd)")}


def lost_node(side: Side) -> int:
    """The node a side loses: node 0 for ``shrink0``, else node 2."""
    return 0 if side.name == "shrink0" else LOST


def survivors(side: Side) -> list[str]:
    """The nodes left after the loss (not the spare), by directory name, the round's lead (after a shrink) first."""
    return [f"node{n}" for n in range(NODES) if n != lost_node(side)]


def state_mb_per_node(width: int) -> float:
    """The trainer's state (weights and momentum, fp32) of a node's one rank at ``width``."""
    return (2 * width * width + 2 * width + 1 + width + 1) * 2 * 4 / 1e6


@dataclass(frozen=True)
class Settings:
    """What every trial shares."""

    warm: float = 20.0  # the job trains this long (from its first step) before the loss
    post: float = 20.0  # step times of the next attempt are taken this long from its first step
    patience: float = 150.0  # the next attempt's first step must come this long after the loss
    width: int = 2500  # 100 MB of state per rank
    micro_batch: int = 8
    global_micro_batches: int = 6  # 2 per rank in 3 ranks, 3 in 2: the global batch kept

    def launch(self, store: tuple[str, ...] = ()) -> Launch:
        """``store``: rlsup's options for the coordination store (etcd's, for ``shrink0``)."""
        return Launch(TRAINER, ("--width", str(self.width), "--micro-batch", str(self.micro_batch),
                                "--global-micro-batches", str(self.global_micro_batches), "--checkpoint-every", "1"),
                      ranks_per_node=1, rlsup_args=("--min-nodes", str(MIN_NODES), *store), rdzv_id="shrink")


QUICK = Settings(warm=10.0, post=12.0)


@dataclass
class Trial:
    """One side's run: its figures, what the rlsup logs said (seconds after the loss), the step times."""

    side: str
    load: float  # 1-minute load average at the trial's start
    figures: LossFigures | None
    marks: dict[str, float] = field(default_factory=dict)
    world_after: int | None = None  # the next attempt's world size (rank 0's ``resumed``)
    replicated: int | None = None  # node 2's newest step whose part node 0 held at the loss
    step_before: float | None = None  # median of rank 0's step times before the loss
    step_after: float | None = None  # ... and in the next attempt, over ``post`` s from its first step
    error: str = ""


def log_marks(job: Job, side: Side, kill_wall: float) -> dict[str, float]:
    """When (after the loss) the rlsup logs say the round went on: node 0's attempt ended; the spare took the rank,
    or node 0 said the job continued on fewer nodes; the first node fetching parts; node 0 launched."""
    def at(name: str, pattern: str) -> float | None:
        return logged_at(job.log_text(name), pattern, kill_wall)

    first = survivors(side)[0]
    fetching = [t for name in (*survivors(side), "node3") if (t := at(name, r"attempt \d+: fetching ranks"))]
    leads = [t for name in survivors(side) if (t := at(name, "leads the round in its place"))]
    marks = {"survivors' attempt ended": at(first, r"attempt \d+ failed"),
             "spare took the rank": at("node3", "took node rank") if side.spares else None,
             "a node left took the lead": min(leads, default=None),
             "continued on fewer nodes": None if side.spares else at(first, r"continued on \d+ of \d+ nodes"),
             "parts fetch began": min(fetching, default=None),
             f"{'node 0' if first == 'node0' else first.replace('node', 'node ')} launched":
                 at(first, r"attempt \d+: launching")}
    return {k: v - kill_wall for k, v in marks.items() if v is not None}


def fresh_replica(job: Job, lost: int, deadline: float) -> int | None:
    """Wait for the node after ``lost`` in the ring (its replica target) to hold a part of it newer than the one it
    holds now (a save replicated right before the loss); the newest it holds then (None: none by ``deadline``)."""
    holder = f"node{(lost + 1) % NODES}"
    was = job.replicated(lost, holder)
    while time.monotonic() < deadline:
        now = job.replicated(lost, holder)
        if now is not None and (was is None or now > was):
            return now
        time.sleep(0.05)
    return job.replicated(lost, holder)


def first_step_after(job: Job, kill_t: float, deadline: float, left: list[str]) -> dict | None:
    """Rank 0's first step in a process started after the SIGKILL, or None by ``deadline`` (or once a node ``left``
    ended)."""
    while time.monotonic() < deadline:
        evs = events(job.root)
        later = {e["pid"] for e in evs if e["ev"] == "start" and e["t"] > kill_t}
        step = next((e for e in evs if e["ev"] == "step" and e["rank"] == 0 and e["pid"] in later), None)
        if step is not None:
            return step
        if any(p.poll() is not None for name, p in job.procs.items() if name in left):
            return None
        time.sleep(0.1)
    return None


def trial(work: Path, side: Side, st: Settings, keep: Path | None, etcd: list[str] | None = None) -> Trial:
    """Start the job (and the spare), lose its node (2, or 0 for ``shrink0``: ``etcd``, the store's endpoints, wiped
    before) once it has trained ``st.warm`` s and a fresh save of it is replicated, and time the job's way back to
    training."""
    load = os.getloadavg()[0]
    lost = lost_node(side)
    store = ("--coordinator-backend", "etcd", "--coordinator-endpoints", ",".join(etcd)) if etcd else ()
    with started_job(work, "shrink", side, NodeLossSettings(), st.launch(store), keep) as job:
        if not trained_for(job, st.warm):
            return Trial(side.name, load, None, error=f"no first step: {tail(job)}")
        replicated = fresh_replica(job, lost, time.monotonic() + 60)
        kill_wall = time.time()
        kill_t = job.lose(f"node{lost}")
        step = first_step_after(job, kill_t, kill_t + st.patience, survivors(side))
        if step is not None:
            while time.monotonic() < step["t"] + st.post:
                time.sleep(0.2)
        evs = events(job.root)
        resumed = next((e for e in evs if e["ev"] == "resumed" and e["t"] > kill_t), None)
        world = resumed.get("world") if resumed else None
        before, after = step_durations(evs, kill_t)
        nodes_after = NODES if side.spares else MIN_NODES
        figs = loss_figures(evs, kill_t, nodes_after, 1, min(st.warm, 10.0), st.post)
        t = Trial(side.name, load, figs, log_marks(job, side, kill_wall), world, replicated, median_or_none(before),
                  median_or_none(after))
        expected = NODES if side.spares else MIN_NODES
        if step is None:
            t.error = f"no first step {st.patience:g} s after the loss: {tail(job)}"
        elif world != expected:
            t.error = f"the next attempt ran {world} ranks, not {expected}"
        return t


def describe(t: Trial) -> str:
    """One trial as a log line."""
    if t.figures is None:
        return f"{t.side}: failed ({t.error})"
    return (f"{t.side}{' FAILED: ' + t.error if t.error else ''}: load {t.load:.1f}; "
            f"{loss_text(t.figures, t.replicated).replace('node 2', f'node {lost_node(SIDES[t.side])}')}; world {t.world_after}; step {fmt(t.step_before, 3)} s before, "
            f"{fmt(t.step_after, 3)} s after; log: {marks_text(t.marks)}")


def figures(res: dict[str, list[Trial]], st: Settings) -> list[Figure]:
    """The shrink's medians against the spare's (the baseline column)."""
    good = {k: [t for t in ts if t.figures is not None and not t.error] for k, ts in res.items()}

    def m(name: str, get: object) -> float | None:
        return med([get(t) for t in good.get(name, [])])  # type: ignore[operator]

    failed = {k: len(ts) - len(good[k]) for k, ts in res.items()}
    head = (f"3 nodes x 1 rank, DDP + gloo, {state_mb_per_node(st.width):.0f} MB/node saved every step and "
            f"replicated; shrink (--min-nodes 2, no spare) vs spare (--spares 1)")
    note = " | ".join(describe(t) for k in ("shrink", "spare") for t in res.get(k, []))
    fails = "; ".join(f"{k}: {n} trial(s) failed" for k, n in failed.items() if n and k != "shrink0")
    without_0 = []
    if "shrink0" in res:
        without_0 = [Figure("node 0 lost -> first step of the next attempt on every node: shrink without node 0 "
                            "(etcd; node 1 or 2 leads the round) vs node 2 lost (shrink)",
                            m("shrink0", lambda t: t.figures.first_step), m("shrink", lambda t: t.figures.first_step),
                            "s", "; ".join(x for x in (f"{failed['shrink0']} trial(s) failed" if failed["shrink0"]
                                                       else "", " | ".join(describe(t) for t in res["shrink0"])) if x))]
    return without_0 + [
        Figure(f"node loss -> first step of the next attempt on every node ({head})",
               m("shrink", lambda t: t.figures.first_step), m("spare", lambda t: t.figures.first_step), "s",
               "; ".join(x for x in (fails, note) if x)),
        Figure("node loss: steps redone (shrink vs spare)", m("shrink", lambda t: t.figures.redone),
               m("spare", lambda t: t.figures.redone), "steps"),
        Figure("step time after the loss: shrunk job (2 ranks x 3 micro batches) vs spare (3 ranks x 2)",
               m("shrink", lambda t: t.step_after), m("spare", lambda t: t.step_after), "s",
               f"before the loss (3 ranks x 2 micro batches): shrink side "
               f"{fmt(m('shrink', lambda t: t.step_before), 3)} s, spare side "
               f"{fmt(m('spare', lambda t: t.step_before), 3)} s; 3 ranks share these 2 cores before the loss and 2 "
               "after, so the shrunk job's step here is not N/(N-1) times the full one's"),
    ]


def run(work: Path, reps: int = 2, st: Settings = Settings(), keep: Path | None = None) -> list[Figure]:
    """Every side ``reps`` times, alternating (spare first; ``shrink0`` where etcd is installed); the table's rows."""
    log(f"shrink: {state_mb_per_node(st.width):.1f} MB of state per node, {reps} rep(s) per side, {st}")
    with contextlib.ExitStack() as stack:
        etcd = etcd_endpoints(work, stack)
        sides = [name for name in SIDES if name != "shrink0" or etcd is not None]

        def one(name: str) -> Trial:
            if name == "shrink0" and etcd is not None:
                etcd.wipe()  # each trial's job starts in an empty store
            return trial(work, SIDES[name], st, keep, etcd.endpoints if name == "shrink0" and etcd else None)
        res = alternating_trials(reps, sides, one, lambda t: f"shrink {describe(t)}")
    return figures(res, st)


def etcd_endpoints(work: Path, stack: contextlib.ExitStack) -> "EtcdCluster | None":
    """A 3-member etcd on 127.0.0.1 for the ``shrink0`` side (stopped with ``stack``), or None (said) without etcd."""
    sys.path.insert(0, str(BENCH.parent / "tests"))
    from etcd_cluster import EtcdCluster, etcd_binary

    if etcd_binary() is None:
        log("shrink: etcd not installed (apt-get install etcd-server): the shrink0 side is skipped")
        return None
    return stack.enter_context(EtcdCluster(work / "etcd"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2, help="repetitions per side (sides alternate)")
    ap.add_argument("--quick", action="store_true", help=f"shorter windows: warm {QUICK.warm:g} s, post {QUICK.post:g} s")
    ap.add_argument("--width", type=int, default=Settings.width, help="the trainer's width (state per node: "
                    f"{state_mb_per_node(Settings.width):.1f} MB at {Settings.width})")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--keep", default=None, help="keep the events and the surviving nodes' rlsup logs here")
    args = ap.parse_args()
    base = QUICK if args.quick else Settings()
    st = Settings(base.warm, base.post, base.patience, args.width, base.micro_batch, base.global_micro_batches)
    return print_figures("rlsup-shrink-", args.dir,
                         lambda work: run(work, args.reps, st, Path(args.keep) if args.keep else None))


if __name__ == "__main__":
    sys.exit(main())
