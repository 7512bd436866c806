"""Accounting of the shrink benchmark (benchmarks/bench_shrink.py), and the node-hours a node loss costs at scale
(BENCHMARKS.md, "Issue 43"): pure functions, tested without processes (tests/benchmarks/test_shrink_accounting.py).

**Step times** come from a trial's events (benchmarks/jobs/shrink_trainer.py's, one ``time.monotonic()`` clock with
the harness's SIGKILL): rank 0's steps before the SIGKILL, and those of the processes started after it (the next
attempt: 3 ranks with a spare, 2 after a shrink, each then taking 3 micro batches of the kept global batch instead
of 2).

**Node-hours lost per node loss**, counted as the README's "How many" counts a requeue: the job's progress lost,
in node-hours of the whole job (N nodes), from the loss until it trains at full speed again:

    spare    N x t_spare                                   (every node waits for the takeover)
    shrink   N x t_shrink + D x N x (1 - (N-1)/N) + N x t_grow
           = N x (t_shrink + t_grow) + D                   (N-1 nodes train for D hours; the lost node's share is
                                                            missing: one node's worth)
    requeue  N x (rendezvous_timeout + restart + queue wait)

``t_spare`` and ``t_shrink`` are the measured loss -> first step times; ``D`` is how long until the lost node (or a
replacement) is back and the job grows back at its next save; ``t_grow`` is the pause of that grow-back (the job
ends its attempt at a save and restarts on N nodes: taken as ``t_shrink``, which also holds the loss's detection).
A spare also costs ``T`` node-hours per allocation whether used or not; :func:`per_allocation` adds it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass


def step_durations(evs: list[dict], kill_t: float) -> tuple[list[float], list[float]]:
    """(rank 0's step times before the SIGKILL, those of the attempt started after it), in event order."""
    later = {e["pid"] for e in evs if e["ev"] == "start" and e["t"] > kill_t}
    steps = sorted((e for e in evs if e["ev"] == "step" and e["rank"] == 0), key=lambda e: e["t"])
    before = [e["dur"] for e in steps if e["t"] <= kill_t]
    after = [e["dur"] for e in steps if e["pid"] in later]
    return before, after


def median_or_none(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


HOUR = 3600.0


@dataclass(frozen=True)
class Assumptions:
    """What the node-hours arithmetic takes as given (seconds unless named in hours)."""

    rendezvous_timeout_s: float = 600.0  # rlsup's default: the survivors wait this long before exit 75
    restart_s: float = 300.0  # a requeued job's start: allocation, start-up, restore (docs/deploy.md's 5 min)
    queue_wait_h: float = 1.0  # a requeue's wait for N nodes
    node_back_h: float = 1.0  # D: until the lost node (or a replacement) is back and the job grows at its next save


@dataclass(frozen=True)
class LossCost:
    """Node-hours of the whole job's progress lost to one node loss, each way of going on."""

    nodes: int
    spare: float
    shrink: float
    requeue: float


def per_loss(nodes: int, spare_s: float, shrink_s: float, a: Assumptions, grow_s: float | None = None) -> LossCost:
    """The node-hours one loss costs a job of ``nodes`` nodes: the spare's takeover, the shrink (its restart, one
    node's share for ``a.node_back_h``, the grow-back's restart: ``grow_s``, default ``shrink_s``) and a requeue."""
    grow = shrink_s if grow_s is None else grow_s
    return LossCost(
        nodes=nodes,
        spare=nodes * spare_s / HOUR,
        shrink=nodes * (shrink_s + grow) / HOUR + a.node_back_h * nodes * (1 - (nodes - 1) / nodes),
        requeue=nodes * (a.rendezvous_timeout_s + a.restart_s + a.queue_wait_h * HOUR) / HOUR,
    )


def poisson_at_least(lam: float, k: int) -> float:
    """P(X >= k) for X ~ Poisson(lam)."""
    return 1.0 - sum(math.exp(-lam) * lam**i / math.factorial(i) for i in range(k))


@dataclass(frozen=True)
class AllocationCost:
    """Expected node-hours lost per allocation of ``hours`` with ``lam`` expected losses, each policy."""

    nodes: int
    lam: float
    requeue: float  # no spare, no shrink: every loss requeues
    shrink: float  # no spare: every loss shrinks (the floor never reached)
    spare_then_requeue: float  # one spare (held all along), then requeues: the README's k = 1
    spare_then_shrink: float  # one spare, then shrinks


def per_allocation(cost: LossCost, hours: float, mtbf_h: float) -> AllocationCost:
    """Losses X ~ Poisson(N x T / M): E[X] losses each cost their policy's node-hours; one spare costs ``hours``
    node-hours and covers the first loss (E[min(X, 1)] = P(X >= 1)), the rest (E[X] - P(X >= 1)) go on the other way."""
    lam = cost.nodes * hours / mtbf_h
    first, rest = poisson_at_least(lam, 1), lam - poisson_at_least(lam, 1)
    return AllocationCost(
        nodes=cost.nodes, lam=lam, requeue=lam * cost.requeue, shrink=lam * cost.shrink,
        spare_then_requeue=hours + first * cost.spare + rest * cost.requeue,
        spare_then_shrink=hours + first * cost.spare + rest * cost.shrink,
    )


def fmt_nh(x: float) -> str:
    """Node-hours as the tables show them: 3 significant digits, no exponent."""
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def loss_table(nodes: list[int], spare_s: float, shrink_s: float, backs_h: list[float], waits_h: list[float],
               base: Assumptions = Assumptions()) -> str:
    """Per loss, Markdown: a row per N; the spare, the shrink for each D in ``backs_h``, the requeue for each queue
    wait in ``waits_h`` (node-hours)."""
    head = (["N", "spare"] + [f"shrink, D = {d:g} h" for d in backs_h] + [f"requeue, queue wait {q:g} h" for q in waits_h])
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join("---:" for _ in head) + " |"]
    for n in nodes:
        cells = [f"{n:,}", fmt_nh(per_loss(n, spare_s, shrink_s, base).spare)]
        cells += [fmt_nh(per_loss(n, spare_s, shrink_s, dataclasses.replace(base, node_back_h=d)).shrink) for d in backs_h]
        cells += [fmt_nh(per_loss(n, spare_s, shrink_s, dataclasses.replace(base, queue_wait_h=q)).requeue)
                  for q in waits_h]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def allocation_table(rows: list[AllocationCost], hours: float, mtbf_h: float) -> str:
    """Per allocation, Markdown: expected node-hours lost under each policy."""
    out = [f"| N | λ = N x {hours:g} / {mtbf_h:,.0f} | requeue every loss | shrink every loss | 1 spare, then requeue | "
           "1 spare, then shrink |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    out += [f"| {r.nodes:,} | {r.lam:.2f} | {fmt_nh(r.requeue)} | {fmt_nh(r.shrink)} | {fmt_nh(r.spare_then_requeue)} | "
            f"{fmt_nh(r.spare_then_shrink)} |" for r in rows]
    return "\n".join(out) + "\n"


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main() -> int:
    """Print the tables of BENCHMARKS.md's node-hours arithmetic for measured ``--spare-s`` and ``--shrink-s``."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spare-s", type=float, required=True, help="measured loss -> first step with a spare")
    ap.add_argument("--shrink-s", type=float, required=True, help="measured loss -> first step after a shrink")
    ap.add_argument("--nodes", default="16,128,1024")
    ap.add_argument("--node-back-h", default="1,4,24", help="D: hours until the lost node is back (shrink columns)")
    ap.add_argument("--queue-wait-h", default="1,4", help="a requeue's queue wait, hours (requeue columns)")
    ap.add_argument("--hours", type=float, default=48.0, help="T: the allocation's hours")
    ap.add_argument("--mtbf-h", type=float, default=5000.0, help="M: node MTBF for losses, hours")
    args = ap.parse_args()
    nodes = [int(x) for x in args.nodes.split(",")]
    print(loss_table(nodes, args.spare_s, args.shrink_s, floats(args.node_back_h), floats(args.queue_wait_h)))
    for wait, back in zip(floats(args.queue_wait_h), floats(args.node_back_h)):
        a = Assumptions(queue_wait_h=wait, node_back_h=back)
        print(f"Per allocation, queue wait {wait:g} h, node back after {back:g} h:\n")
        print(allocation_table([per_allocation(per_loss(n, args.spare_s, args.shrink_s, a), args.hours, args.mtbf_h)
                                for n in nodes], args.hours, args.mtbf_h))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
