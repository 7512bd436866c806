"""When to restart and how long to wait: retries within a window, exponential backoff with jitter,
fatal exit codes, and the no-progress guard."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field


@dataclass
class RestartDecision:
    restart: bool
    delay_s: float
    action: str  # restart | give_up | fatal | no_progress


@dataclass
class RestartPolicy:
    max_restarts: int
    restart_window: float
    backoff_initial: float
    backoff_max: float
    backoff_jitter: float
    fatal_exit_codes: list[int]
    max_no_progress_attempts: int
    failures: list[float] = field(default_factory=list)
    consecutive: int = 0
    no_progress_streak: int = 0
    rng: random.Random = field(default_factory=random.Random)

    def record_success_progress(self, progressed: bool) -> None:
        self.no_progress_streak = 0 if progressed else self.no_progress_streak + 1

    def decide(self, exit_code: int | None, progressed: bool, now: float | None = None) -> RestartDecision:
        """Called once per failed attempt, in order."""
        now = time.monotonic() if now is None else now
        if exit_code is not None and exit_code in self.fatal_exit_codes:
            return RestartDecision(False, 0.0, "fatal")
        self.record_success_progress(progressed)
        if self.max_no_progress_attempts and self.no_progress_streak >= self.max_no_progress_attempts:
            return RestartDecision(False, 0.0, "no_progress")
        self.failures.append(now)
        if self.restart_window > 0:
            self.failures = [t for t in self.failures if now - t <= self.restart_window]
        if len(self.failures) > self.max_restarts:
            return RestartDecision(False, 0.0, "give_up")
        self.consecutive = self.consecutive + 1 if progressed is False else 1
        delay = min(self.backoff_max, self.backoff_initial * (2 ** (self.consecutive - 1)))
        if self.backoff_jitter:
            delay *= 1 + self.rng.uniform(-self.backoff_jitter, self.backoff_jitter)
        return RestartDecision(True, max(0.0, delay), "restart")
