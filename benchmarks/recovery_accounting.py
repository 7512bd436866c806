"""Goodput and per-failure accounting of the realistic recovery harness (benchmarks/bench_recovery.py),
from a trial's recorded events alone: pure functions, so the arithmetic is tested without processes.

Events are the trainer's JSON lines (``ev``, ``t``, ``rank``, ``attempt``, and ``step``/``dur``) on one
``time.monotonic()`` clock with the harness's kills. Only rank 0's step events count: the ranks step
together (an all-reduce per step).

- **Useful** steps are the steps of the final lineage: the step rank 0 had reached at the end of the
  window. A step trained, lost with a failure and trained again is counted once; the first run of it
  is *redone* work.
- **Goodput** = useful steps x the reference step time (one step on this machine with no save and no
  failure) / wall window. Counting steps at a fixed price, not the measured step durations, charges a
  side whose saves slow its steps down (a writer process competing for the CPU) for that slowdown.
- Per failure (a kill of an attempt that had trained; a kill of an attempt still recovering, e.g. one
  retrying a refused gloo connection, is part of the failure before it): the kill -> the next training attempt's rank 0 starts (detection, teardown, failed
  restarts, relaunch, interpreter), -> rendezvous, -> restored, -> first step, the steps redone, and
  the time until the job is past the step it had reached at the kill (everything the failure cost).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Kill:
    """One SIGKILL sent by the harness."""

    t: float
    rank: int
    attempt: int


@dataclass(frozen=True)
class Recovery:
    """Where one failure's time went, in seconds (None: the job never got that far in the window)."""

    to_start: float | None  # kill -> rank 0 of the next attempt that trains runs its first line
    rendezvous: float | None  # -> init_process_group done
    restore: float | None  # -> state restored (model, optimizer, checkpoint)
    first_step: float | None  # -> its first step done
    redone: int | None  # steps trained before the kill and trained again
    regained: float | None  # kill -> the job is past the step it had reached at the kill
    failed_restarts: int  # attempts after the kill that never trained (e.g. gloo connectFullMesh refused)


@dataclass(frozen=True)
class Trial:
    """One side's run: the figures of the harness's table."""

    goodput: float
    useful_steps: int
    trained_steps: int  # every step event, redone ones included
    kills: int
    recoveries: list[Recovery] = field(default_factory=list)  # one per kill of an attempt that had trained
    kills_in_recovery: int = 0  # kills of an attempt that had not trained yet: part of the failure before
    save_blocked_s: float = 0.0  # rank 0's time blocked in saves, in the window
    median_step_s: float | None = None  # measured step durations (saves excluded)

    @property
    def redone_per_failure(self) -> float | None:
        xs = [r.redone for r in self.recoveries if r.redone is not None]
        return sum(xs) / len(xs) if xs else None


def rank0(evs: list[dict], t_end: float) -> list[dict]:
    """Rank 0's events up to ``t_end``, in time order."""
    return sorted((e for e in evs if e.get("rank") == 0 and e["t"] <= t_end), key=lambda e: e["t"])


def recovery_of(evs: list[dict], kill: Kill, t_end: float) -> Recovery:
    """What the failure ``kill`` cost (``evs``: rank 0's events in time order, up to the window's end)."""
    before = [e["step"] for e in evs if e["ev"] == "step" and e["t"] <= kill.t]
    reached = max(before, default=0)
    later = [e for e in evs if e["t"] > kill.t and e["attempt"] > kill.attempt]
    trained = sorted({e["attempt"] for e in later if e["ev"] == "step"})
    started = sorted({e["attempt"] for e in later if e["ev"] == "start"})
    if not trained:  # the newest attempt may still be coming up when the window ends: not counted failed
        return Recovery(None, None, None, None, None, None, max(0, len(started) - 1))
    a = trained[0]

    def first(ev: str) -> dict | None:
        return next((e for e in later if e["attempt"] == a and e["ev"] == ev), None)

    marks = [first("start"), first("rendezvous"), first("resumed"), first("step")]
    times = [kill.t] + [m["t"] if m else None for m in marks]
    gaps = [b - x if b is not None and x is not None else None for x, b in zip(times, times[1:])]
    resumed = marks[2]
    redone = max(0, reached - resumed["step"]) if resumed is not None else None
    past = next((e["t"] for e in later if e["ev"] == "step" and e["step"] > reached), None)
    return Recovery(*gaps, redone, past - kill.t if past is not None else None,
                    len([x for x in started if x < a]))


def account(evs: list[dict], kills: list[Kill], t0: float, t_end: float, ref_step_s: float) -> Trial:
    """The figures of one trial: events ``evs`` and ``kills`` over the window ``[t0, t_end]``."""
    mine = rank0(evs, t_end)
    steps = [e for e in mine if e["ev"] == "step" and e["t"] >= t0]
    useful = steps[-1]["step"] if steps else 0
    saves = sum(e["dur"] for e in mine if e["ev"] == "save" and e["t"] >= t0)
    durs = [e["dur"] for e in steps]
    trained = [k for k in kills if any(e["ev"] == "step" and e["attempt"] == k.attempt and e["t"] <= k.t
                                       for e in mine)]
    return Trial(goodput=useful * ref_step_s / (t_end - t0), useful_steps=useful, trained_steps=len(steps),
                 kills=len(kills), recoveries=[recovery_of(mine, k, t_end) for k in trained],
                 kills_in_recovery=len(kills) - len(trained), save_blocked_s=saves,
                 median_step_s=statistics.median(durs) if durs else None)


def young_cadence(save_s: float, mtbf_s: float, step_s: float) -> int:
    """Steps between saves that maximise goodput to first order (Young: interval = sqrt(2 x save cost x
    mean time between failures)), at least 1."""
    return max(1, round(math.sqrt(2 * save_s * mtbf_s) / step_s))


def kill_schedule(seed: int, window_s: float, lo: float, hi: float, ranks: int) -> list[tuple[float, int]]:
    """(seconds after the start, rank) of every kill in the window: gaps uniform in [lo, hi], a uniform
    rank; the same seed gives every side the same faults."""
    import random

    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.uniform(lo, hi)
        if t >= window_s:
            return out
        out.append((t, rng.randrange(ranks)))
