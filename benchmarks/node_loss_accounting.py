"""Accounting of the node-loss harness (benchmarks/bench_node_loss.py) from a trial's recorded events alone:
pure functions, so the arithmetic is tested without processes (tests/benchmarks/test_bench_node_loss.py).

Events are benchmarks/jobs/recovery_trainer.py's JSON lines (``ev``, ``t``, ``rank``, ``pid``, and
``step``/``dur``) on one ``time.monotonic()`` clock with the harness's SIGKILL. Every rank says ``start``;
rank 0 also says ``rendezvous``, ``resumed`` (step) and, per step, ``step`` (step, dur: compute + all-reduce +
optimizer, the save excluded). A step ends in an all-reduce over every rank of every node, so rank 0's first
step of the next attempt is done only once every node's ranks have joined it: it stands for "the first step
of the next attempt on every node".

- **Loss -> first step**: the SIGKILL -> rank 0's first step in a process started after the SIGKILL.
- **Phases**: the SIGKILL -> each node's ranks all started (the newest ``start`` of the node's ranks after the
  SIGKILL) -> rank 0's rendezvous -> restored (``resumed``) -> first step.
- **Steps redone**: the step rank 0 had reached at the SIGKILL minus the step the next attempt resumed from.
- **Goodput** over a window: the time of the steps of the final lineage (the last run of each step number up
  to the newest step at the window's end) that ended in the window, over the window. A step lost with the node
  and trained again counts once; time spent detecting, waiting, restoring and saving counts as lost.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LossFigures:
    """What one node loss cost (seconds after the SIGKILL; None: not reached in the trial)."""

    first_step: float | None  # -> rank 0's first step of the next attempt (every node's ranks in it)
    nodes_started: tuple[float | None, ...]  # -> every rank of node k started (rank // ranks_per_node == k)
    rendezvous: float | None  # -> rank 0 past init_process_group
    restored: float | None  # -> rank 0 restored its state
    reached: int  # the step rank 0 had reached at the SIGKILL
    resumed: int | None  # the step the next attempt resumed from
    goodput: float  # useful step time / wall over the trial's window
    steady_goodput: float  # the same over the window's part before the SIGKILL

    @property
    def redone(self) -> int | None:
        return None if self.resumed is None else max(0, self.reached - self.resumed)

    @property
    def last_node_started(self) -> float | None:
        xs = [x for x in self.nodes_started if x is not None]
        return max(xs) if len(xs) == len(self.nodes_started) and xs else None


def after_kill(evs: list[dict], kill_t: float) -> list[dict]:
    """The events of processes started after the SIGKILL (the next attempts), in time order."""
    pids = {e["pid"] for e in evs if e["ev"] == "start" and e["t"] > kill_t}
    return sorted((e for e in evs if e["pid"] in pids and e["t"] > kill_t), key=lambda e: e["t"])


def useful_time(evs: list[dict], t0: float, t1: float) -> float:
    """Seconds of rank 0's steps of the final lineage that ended within ``[t0, t1]``."""
    steps = sorted((e for e in evs if e["ev"] == "step" and e["rank"] == 0 and e["t"] <= t1), key=lambda e: e["t"])
    if not steps:
        return 0.0
    final = steps[-1]["step"]
    last: dict[int, dict] = {}
    for e in steps:  # later runs of a step number replace earlier ones: the last run is the lineage's
        if e["step"] <= final:
            last[e["step"]] = e
    return sum(e["dur"] for e in last.values() if e["t"] >= t0)


def loss_figures(evs: list[dict], kill_t: float, nodes: int, ranks_per_node: int, pre_s: float,
                 post_s: float) -> LossFigures:
    """The figures of one trial whose node was SIGKILLed at ``kill_t``; the goodput window is
    ``[kill_t - pre_s, kill_t + post_s]``."""
    later = after_kill(evs, kill_t)

    def first(ev: str) -> dict | None:
        return next((e for e in later if e["ev"] == ev and e["rank"] == 0), None)

    def node_started(node: int) -> float | None:
        ts = [min((e["t"] for e in later if e["ev"] == "start" and e["rank"] == r), default=None)
              for r in range(node * ranks_per_node, (node + 1) * ranks_per_node)]
        return None if None in ts else max(ts) - kill_t  # type: ignore[type-var]

    marks = [first(ev) for ev in ("step", "rendezvous", "resumed")]
    step, rdzv, resumed = (m["t"] - kill_t if m is not None else None for m in marks)
    reached = max((e["step"] for e in evs if e["ev"] == "step" and e["rank"] == 0 and e["t"] <= kill_t), default=0)
    t0, t1 = kill_t - pre_s, kill_t + post_s
    return LossFigures(first_step=step, nodes_started=tuple(node_started(n) for n in range(nodes)),
                       rendezvous=rdzv, restored=resumed, reached=reached,
                       resumed=marks[2]["step"] if marks[2] is not None else None,
                       goodput=useful_time(evs, t0, t1) / (t1 - t0),
                       steady_goodput=useful_time(evs, t0, kill_t) / pre_s if pre_s > 0 else 0.0)
