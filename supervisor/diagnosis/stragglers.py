"""Stragglers: a rank whose own work per step stays slower than its peers' by a factor.

In synchronous training every rank's step interval equals the slowest rank's, so intervals name
nobody. What differs is each rank's own work before the step's collective. Two ways to see it:

* **arrival** (trainers that heartbeat before the collective: the step, the heartbeat, the
  all-reduce): the collective of step s-1 releases every rank at about the same moment, the last
  arrival; a rank's work on step s is its arrival at s minus that release. The heartbeat record
  keeps each rank's last two beats, so one poll sees every rank at the same step.
* **work section** (trainers that heartbeat after the collective, where arrivals are equal):
  ``trainer_hooks.section("work")`` times the rank's forward/backward; rlsup reads the last duration.

Each sample is a rank's work over the median of its peers'. A rank is flagged when its last
``window`` samples all reach ``factor`` (one slow step, a save on rank 0, is not a straggler), and
cleared when they all fall below it again. NVRx flags ranks below 0.7 of their peers' throughput; ``factor``
is the inverse view (1/0.7 = 1.43). Stdlib only: the run loop feeds it the records it already reads.
"""

from __future__ import annotations

import collections
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from rlsup_format.heartbeat_record import HeartbeatRecord
from rlsup_format.state_files import STRAGGLERS

if TYPE_CHECKING:
    from supervisor.observer import Observer

KEEP_STEPS = 64  # arrivals remembered per rank for steps not yet evaluated
MIN_WORK_NS = 1_000_000  # peers' median below 1 ms is noise, not a baseline to divide by


@dataclass
class StragglerReport:
    """A rank flagged (or cleared) as a straggler: what ``stragglers.jsonl`` and the log carry."""

    time: float
    attempt: int
    rank: int
    pid: int
    node: str
    ratio: float  # median of the window: this rank's work over its peers' median
    samples: list[float]
    method: str  # "arrival" or "work_section"
    step: int
    cleared: bool = False

    def describe(self) -> str:
        if self.cleared:
            return f"rank {self.rank} on node {self.node} no longer straggles (step {self.step})"
        return (f"straggler: rank {self.rank} (pid {self.pid}) on node {self.node} works {self.ratio:.1f}x its "
                f"peers' median over its last {len(self.samples)} steps ({self.method}, step {self.step})")


@dataclass
class StragglerDetector:
    """One attempt's detector; :meth:`feed` it every poll's records, it returns flag changes."""

    factor: float
    window: int
    node: str = ""
    attempt: int = 0
    arrivals: dict[int, dict[int, int]] = field(default_factory=dict)  # step -> rank -> beat_ns
    evaluated: set[int] = field(default_factory=set)
    samples: dict[int, collections.deque] = field(default_factory=dict)
    works_seen: dict[int, int] = field(default_factory=dict)
    flagged: set[int] = field(default_factory=set)
    ratios: dict[int, float] = field(default_factory=dict)  # latest sample per rank (metrics)

    def feed(self, records: Mapping[int, HeartbeatRecord]) -> list[StragglerReport]:
        records = {r: rec for r, rec in records.items() if r >= 0}  # ranks only, not the job's output
        if self.factor <= 0 or len(records) < 2:
            return []
        if any(r.works for r in records.values()):
            self._from_work_sections(records)
        else:
            self._from_arrivals(records)
        return self._flag_changes(records)

    def _sample(self, rank: int, ratio: float) -> None:
        self.samples.setdefault(rank, collections.deque(maxlen=self.window)).append(ratio)
        self.ratios[rank] = ratio

    def _from_work_sections(self, records: Mapping[int, HeartbeatRecord]) -> None:
        if any(r.works == 0 for r in records.values()) or \
                all(self.works_seen.get(r.rank) == r.works for r in records.values()):
            return  # not every rank has timed its work yet, or nothing new since the last poll
        for rec in records.values():
            self.works_seen[rec.rank] = rec.works
            peers = [r.work_ns for r in records.values() if r.rank != rec.rank]
            self._sample(rec.rank, rec.work_ns / max(statistics.median(peers), MIN_WORK_NS))

    def _from_arrivals(self, records: Mapping[int, HeartbeatRecord]) -> None:
        for rec in records.values():
            for step, beat in ((rec.step, rec.beat_ns), (rec.prev_step, rec.prev_beat_ns)):
                if beat > 0 and step >= 0 and step not in self.evaluated:
                    self.arrivals.setdefault(step, {})[rec.rank] = beat
        ranks = set(records)
        for step in sorted(s for s in self.arrivals if s not in self.evaluated):
            before = self.arrivals.get(step - 1)
            here = self.arrivals[step]
            if set(here) != ranks or before is None or set(before) != ranks:
                continue
            release = max(before.values())  # the step's collective let everyone go at the last arrival
            work = {r: max(0, t - release) for r, t in here.items()}
            for rank, ns in work.items():
                peers = [w for r, w in work.items() if r != rank]
                self._sample(rank, ns / max(statistics.median(peers), MIN_WORK_NS))
            self.evaluated.add(step)
        newest = max(self.arrivals, default=0)
        for step in [s for s in self.arrivals if s < newest - KEEP_STEPS]:
            del self.arrivals[step]
        self.evaluated = {s for s in self.evaluated if s >= newest - KEEP_STEPS}

    def _flag_changes(self, records: Mapping[int, HeartbeatRecord]) -> list[StragglerReport]:
        out = []
        method = "work_section" if any(r.works for r in records.values()) else "arrival"
        for rank, window in self.samples.items():
            rec = records.get(rank)
            if rec is None:
                continue
            full = len(window) == self.window
            was = rank in self.flagged  # flag when all of the window is slow, clear when all of it is fast
            slow = (full and min(window) >= self.factor) if not was else not (full and max(window) < self.factor)
            if slow == was:
                continue
            (self.flagged.add if slow else self.flagged.discard)(rank)
            out.append(StragglerReport(time.time(), self.attempt, rank, rec.pid, self.node,
                                       round(statistics.median(window), 2), [round(x, 2) for x in window],
                                       method, rec.step, cleared=not slow))
        return out


@dataclass
class StragglerWatch:
    """One attempt's straggler reporting: detector plus what a flag change does (log, record,
    metric), and whether ``straggler_action: restart`` ends the attempt."""

    detector: StragglerDetector
    state_dir: Path
    restart: bool
    log: Callable[[str], None]
    observer: "Observer"

    def poll(self, records: Mapping[int, HeartbeatRecord]) -> StragglerReport | None:
        """Feed one poll's records; the report that should end the attempt (restart mode), else None."""
        ending = None
        for report in self.detector.feed(records):
            self.log(f"attempt {report.attempt}: {report.describe()}")
            append_report(self.state_dir, report)
            if not report.cleared:
                self.observer.suspect(report.node, "straggler")
                ending = ending or (report if self.restart else None)
        # A rank not yet measured (or without peers) is in step: 1.
        self.observer.stragglers(len(self.detector.flagged), {r: self.detector.ratios.get(r, 1.0) for r in records})
        return ending


def append_report(state_dir: Path, report: StragglerReport) -> None:
    import json
    import os
    from dataclasses import asdict

    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / STRAGGLERS, "a") as f:
        f.write(json.dumps(asdict(report), sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_reports(state_dir: Path) -> list[dict]:
    import json

    out = []
    try:
        lines = (state_dir / STRAGGLERS).read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a torn last line
    return out
