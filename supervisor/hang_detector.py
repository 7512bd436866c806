"""Decide from the ranks' heartbeat files whether an attempt is hung.

Rules (all on CLOCK_MONOTONIC, so wall-clock jumps never look like hangs):
- no rank heartbeats within ``startup_timeout`` of launch: hung at startup;
- a rank inside a ``save``/``load`` section, or exiting after its last step (``exit``, marked by
  trainer_hooks at interpreter exit), longer than ``save_timeout``: hung there;
- otherwise a rank silent for longer than the heartbeat timeout: hung.
The heartbeat timeout is explicit, or learned ("auto") as nvidia-resiliency-ext does: a safety factor
times the longest interval seen between heartbeats, with a floor, and a generous initial value until
enough intervals were seen. What was learned carries over to later attempts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rlsup_format.fileio import pid_alive
from rlsup_format.heartbeat_record import HeartbeatRecord, read_record
from supervisor.progress import JOB_RANK, job_level_only, speaking_records

# Sections whose silence is measured against save_timeout: a save, a restore, and the interpreter's
# exit after the last step (trainer_hooks marks it at exit).
HELD_TO_SAVE_TIMEOUT = ("save", "load", "exit")

if TYPE_CHECKING:
    from supervisor.config import SupervisorConfig


@dataclass(frozen=True)
class HangSettings:
    """The hang detector's part of the config (keys of the same names; ``heartbeat_timeout`` None: auto)."""

    startup_timeout: float = 600.0
    save_timeout: float = 1800.0
    heartbeat_timeout: float | None = None
    heartbeat_timeout_initial: float = 600.0
    auto_timeout_factor: float = 5.0
    auto_timeout_floor: float = 30.0
    auto_timeout_min_intervals: int = 5

    @classmethod
    def from_config(cls, cfg: "SupervisorConfig") -> "HangSettings":
        return cls(cfg.startup_timeout, cfg.save_timeout, cfg.heartbeat_timeout, cfg.heartbeat_timeout_initial,
                   cfg.auto_timeout_factor, cfg.auto_timeout_floor, cfg.auto_timeout_min_intervals)


@dataclass
class HangVerdict:
    """Why an attempt is considered hung."""

    reason: str  # "startup_timeout" | "heartbeat_timeout" | "save_timeout"
    rank: int | None
    pid: int | None
    silent_s: float
    timeout_s: float
    step: int | None


@dataclass
class AutoTimeout:
    """Learned heartbeat timeout; survives across attempts of one supervisor."""

    factor: float
    floor: float
    initial: float
    min_intervals: int
    intervals_seen: int = 0
    longest_interval: float = 0.0

    @classmethod
    def from_settings(cls, s: HangSettings) -> "AutoTimeout":
        return cls(s.auto_timeout_factor, s.auto_timeout_floor, s.heartbeat_timeout_initial,
                   s.auto_timeout_min_intervals)

    def observe(self, interval_s: float) -> None:
        if interval_s > 0:
            self.intervals_seen += 1
            self.longest_interval = max(self.longest_interval, interval_s)

    def current(self) -> float:
        if self.intervals_seen < self.min_intervals:
            return self.initial
        return max(self.floor, self.factor * self.longest_interval)


@dataclass
class HangDetector:
    """Watches one attempt's heartbeat directory."""

    directory: Path
    startup_timeout: float
    save_timeout: float
    explicit_timeout: float | None
    auto: AutoTimeout
    started_ns: int = field(default_factory=time.monotonic_ns)
    records: dict[int, HeartbeatRecord] = field(default_factory=dict)
    alive: Callable[[int], bool] = field(default=lambda pid: pid_alive(pid))

    @classmethod
    def from_settings(cls, directory: Path, s: HangSettings, auto: AutoTimeout,
                      alive: Callable[[int], bool] | None = None) -> "HangDetector":
        """One attempt's detector; ``auto`` is shared by the attempts of a run (what it learned carries over)."""
        det = cls(directory, s.startup_timeout, s.save_timeout, s.heartbeat_timeout, auto)
        det.alive = alive or det.alive
        return det

    def timeout(self) -> float:
        return self.explicit_timeout if self.explicit_timeout is not None else self.auto.current()

    def scan(self) -> dict[int, HeartbeatRecord]:
        """Read every rank file; feed new step intervals to the auto timeout."""
        for path in self.directory.glob("rank_*.hb"):
            rec = read_record(path)
            if rec is None:
                continue
            old = self.records.get(rec.rank)
            if rec.rank == JOB_RANK and not job_level_only(self.records.values()):
                pass  # ranks heartbeat themselves: their intervals, not the output's, teach the timeout
            elif old is not None and old.pid == rec.pid and rec.beat_ns > old.beat_ns > 0 and rec.section == "none" \
                    and old.section == "none" and rec.section_ns <= old.beat_ns:
                self.auto.observe((rec.beat_ns - old.beat_ns) / 1e9)
            self.records[rec.rank] = rec
        return self.records

    def check(self, now_ns: int | None = None) -> HangVerdict | None:
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        records = self.scan()
        records = speaking_records(records)  # trainer_hooks' heartbeats take precedence
        beating = [r for r in records.values() if r.beat_ns > 0]
        if not beating:
            return self._check_startup(now_ns, records)
        timeout = self.timeout()
        for rec in sorted(records.values(), key=lambda r: r.rank):
            if rec.section in HELD_TO_SAVE_TIMEOUT:
                silent = (now_ns - rec.section_ns) / 1e9
                if silent > self.save_timeout:
                    return HangVerdict("save_timeout", rec.rank, rec.pid, silent, self.save_timeout, rec.step)
                continue
            if rec.beat_ns == 0:
                # Registered (a section ran) but never beat: covered by the startup rule.
                silent = (now_ns - max(self.started_ns, rec.section_ns)) / 1e9
                if silent > self.startup_timeout:
                    return HangVerdict("startup_timeout", rec.rank, rec.pid, silent, self.startup_timeout, None)
                continue
            last = max(rec.beat_ns, rec.section_ns)  # a section that just ended counts as a sign of life
            silent = (now_ns - last) / 1e9
            if silent > timeout and self.alive(rec.pid):  # an exited rank is not silent: the job is ending
                return HangVerdict("heartbeat_timeout", rec.rank, rec.pid, silent, timeout, rec.step)
        return None

    def _check_startup(self, now_ns: int, records: dict[int, HeartbeatRecord]) -> HangVerdict | None:
        """Before any rank heartbeated. A rank inside a save/load section (the first restore of a large
        checkpoint) is held to save_timeout, not startup_timeout; startup restarts when a section ends."""
        in_section = [r for r in records.values() if r.section in HELD_TO_SAVE_TIMEOUT]
        for rec in sorted(in_section, key=lambda r: r.rank):
            silent = (now_ns - rec.section_ns) / 1e9
            if silent > self.save_timeout:
                return HangVerdict("save_timeout", rec.rank, rec.pid, silent, self.save_timeout, None)
        if in_section:
            return None
        since = max([self.started_ns] + [r.section_ns for r in records.values()])
        silent = (now_ns - since) / 1e9
        if silent > self.startup_timeout:
            return HangVerdict("startup_timeout", None, None, silent, self.startup_timeout, None)
        return None

    def last_step(self) -> int | None:
        steps = [r.step for r in speaking_records(self.records).values() if r.beat_ns > 0]
        return max(steps) if steps else None

