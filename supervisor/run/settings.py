"""The run loop's part of the config: what :class:`supervisor.run.loop.Supervisor` and the parts it drives
(launch, watch, stop, health check, resume) read, built once from the resolved config.

The other components have their own settings objects (``RestartSettings``, ``HangSettings``, ``SightSettings``,
``PersistentSettings``, ...); this one holds the keys only the loop reads, so the loop never reads the
config itself and keeps none of it.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from supervisor.config import SupervisorConfig


@dataclass(frozen=True)
class RunSettings:
    """Paths are absolute (built from ``SupervisorConfig.resolved()``)."""

    state_dir: Path
    checkpoint_dir: Path
    poll_interval: float  # seconds between checks of the job's processes and heartbeats
    # resume point
    resume: bool
    checkpoint_layout: str
    repair_tracker: bool
    # launch
    output_tail_lines: int
    progress: str
    progress_regex: str
    warm_launcher: bool
    warm_imports: tuple[str, ...]
    warm_cuda: bool
    warm_fork: bool
    warm_first_attempt: bool
    pre_launch_check: str
    pre_launch_timeout: float
    # stop and cleanup
    preempt_signal: signal.Signals
    stop_grace: float
    kill_grace: float
    # stragglers
    straggler_factor: float
    straggler_window: int
    straggler_restart: bool  # straggler_action: restart (a straggler ends the attempt); else report only

    @classmethod
    def from_config(cls, cfg: "SupervisorConfig") -> "RunSettings":
        """``cfg`` resolved (absolute paths) and validated (the preemption signal exists)."""
        return cls(
            state_dir=Path(cfg.state_dir), checkpoint_dir=Path(cfg.checkpoint_dir), poll_interval=cfg.poll_interval,
            resume=cfg.resume, checkpoint_layout=cfg.checkpoint_layout, repair_tracker=cfg.repair_tracker,
            output_tail_lines=cfg.output_tail_lines, progress=cfg.progress, progress_regex=cfg.progress_regex,
            warm_launcher=cfg.warm_launcher, warm_imports=tuple(cfg.warm_imports),
            warm_cuda=cfg.warm_cuda, warm_fork=cfg.warm_fork, warm_first_attempt=cfg.warm_first_attempt,
            pre_launch_check=cfg.pre_launch_check,
            pre_launch_timeout=cfg.pre_launch_timeout,
            preempt_signal=signal_named(cfg.preempt_signal), stop_grace=cfg.stop_grace, kill_grace=cfg.kill_grace,
            straggler_factor=cfg.straggler_factor, straggler_window=cfg.straggler_window,
            straggler_restart=cfg.straggler_action == "restart")


def signal_named(name: str) -> signal.Signals:
    """``SIGUSR1`` or ``USR1`` as the signal; ValueError naming it when there is no such signal."""
    full = name if name.startswith("SIG") else "SIG" + name
    try:
        return signal.Signals[full]
    except KeyError:
        raise ValueError(f"unknown signal {name!r}") from None
