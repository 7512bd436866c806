"""When to restart and how long to wait: retries within a window, exponential backoff with jitter,
fatal exit codes, and the no-progress guard.

The first failure after a healthy run (the job's first, or one after an attempt that made a newer
valid checkpoint) restarts at once: most failures are one-off crashes that a restart fixes, and every
second of delay is lost training. Backoff (``backoff_initial``, doubling) applies from the second
failure in a row without progress, so a crash loop is still slowed."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from supervisor.lifecycle import Action

if TYPE_CHECKING:
    from supervisor.run.incidents import Incident
    from supervisor.config import SupervisorConfig


@dataclass(frozen=True)
class RestartSettings:
    """The restart policy's part of the config (keys of the same names)."""

    max_restarts: int = 3
    restart_window: float = 3600.0
    backoff_initial: float = 1.0
    backoff_max: float = 60.0
    backoff_jitter: float = 0.2
    fatal_exit_codes: tuple[int, ...] = ()
    max_no_progress_attempts: int = 5

    @classmethod
    def from_config(cls, cfg: "SupervisorConfig") -> "RestartSettings":
        return cls(cfg.max_restarts, cfg.restart_window, cfg.backoff_initial, cfg.backoff_max, cfg.backoff_jitter,
                   tuple(cfg.fatal_exit_codes), cfg.max_no_progress_attempts)


@dataclass
class RestartDecision:
    restart: bool
    delay_s: float
    action: Action


@dataclass
class RestartPolicy:
    """One run's restart decisions: the settings, and the failures and streaks seen so far."""

    settings: RestartSettings = field(default_factory=RestartSettings)
    failures: list[float] = field(default_factory=list)
    consecutive: int = 0
    no_progress_streak: int = 0
    rng: random.Random = field(default_factory=random.Random)

    @classmethod
    def from_config(cls, cfg: "SupervisorConfig") -> "RestartPolicy":
        return cls(RestartSettings.from_config(cfg))

    def budget_left(self) -> bool:
        """Whether one more failure could still be restarted (max_restarts not used up in the window)."""
        return len(self.failures) < self.settings.max_restarts

    def record_success_progress(self, progressed: bool) -> None:
        self.no_progress_streak = 0 if progressed else self.no_progress_streak + 1

    def decide(self, exit_code: int | None, progressed: bool, now: float | None = None) -> RestartDecision:
        """Called once per failed attempt, in order."""
        s = self.settings
        now = time.monotonic() if now is None else now
        if exit_code is not None and exit_code in s.fatal_exit_codes:
            return RestartDecision(False, 0.0, Action.FATAL)
        self.record_success_progress(progressed)
        if s.max_no_progress_attempts and self.no_progress_streak >= s.max_no_progress_attempts:
            return RestartDecision(False, 0.0, Action.NO_PROGRESS)
        self.failures.append(now)
        if s.restart_window > 0:
            self.failures = [t for t in self.failures if now - t <= s.restart_window]
        if len(self.failures) > s.max_restarts:
            return RestartDecision(False, 0.0, Action.GIVE_UP)
        self.consecutive = self.consecutive + 1 if progressed is False else 1
        if self.consecutive == 1:  # the first failure after a healthy run: restart at once
            return RestartDecision(True, 0.0, Action.RESTART)
        delay = min(s.backoff_max, s.backoff_initial * (2 ** (self.consecutive - 2)))
        if s.backoff_jitter:
            delay *= 1 + self.rng.uniform(-s.backoff_jitter, s.backoff_jitter)
        return RestartDecision(True, max(0.0, delay), Action.RESTART)


def give_up_code(action: Action, result: "Incident", max_no_progress: int) -> tuple[int, str]:
    """rlsup's exit code when it gives up after the attempt of ``result`` (its incident), and the line that says
    why, with the step it reached (``result.last_step``: :func:`supervisor.run.progress_rule.step_reached`), never
    a resume."""
    from supervisor import exit_codes

    at = "" if result.last_step is None else f" at step {result.last_step}"
    if action == Action.NO_PROGRESS:
        return exit_codes.NO_PROGRESS, (f"giving up{at}: {max_no_progress} attempts in a row made no progress (no "
                                        "newer valid checkpoint, nor a step past the highest an earlier attempt "
                                        "reached)")
    code = exit_codes.for_job_code(result.exit_code)
    mapped = f" (the job's exit code {result.exit_code} is one of rlsup's own: exiting {code})" \
        if result.exit_code in exit_codes.RESERVED else ""
    if action == Action.FATAL:
        return code, f"exit code {result.exit_code} is fatal: not retrying{at}{mapped}"
    return code, f"giving up after {result.attempt + 1} attempts{at}{mapped}"
