"""The run loop's side of the warm launcher: the next attempt's pre-spawned job root, armed while an
attempt runs and used (or discarded) when the next one launches (:mod:`supervisor.launch.warm_launcher`)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Callable, Sequence

from supervisor.processes.job import JobProcess
from supervisor.launch.warm_launcher import Zygote, warm_spec


#: How long an attempt waits for a launcher armed beside the previous one to be ready (it had that attempt's run)...
ARMED_READY_S = 30.0
#: ... and for one spawned for the attempt itself (``arm_now``): its import is the attempt's own start, which a cold
#: torchrun would spend as well (on a cold page cache or a shared file system, more than 30 s); past it, cold.
JUST_IN_TIME_READY_S = 120.0


class WarmStarts:
    """At most one waiting launcher for ``command`` (torchrun jobs with ``warm_launcher`` on)."""

    def __init__(self, command: Sequence[str], enabled: bool, warm_imports: Sequence[str],
                 log: Callable[[str], None], warm_cuda: bool = False, warm_fork: bool = True) -> None:
        self.command, self.enabled, self.warm_imports, self.log = list(command), enabled, tuple(warm_imports), log
        self.warm_cuda, self.warm_fork = warm_cuda, warm_fork
        self._zygote: Zygote | None = None
        self._armed: list[str] = []  # the command the waiting launcher was armed for
        self._ready_timeout = ARMED_READY_S

    def adopt(self, command: Sequence[str], log: Callable[[str], None]) -> None:
        """A new owner goes on with this launcher (a spare that became a node: its command is now pinned to the
        node rank it took). The waiting launcher keeps what it was armed for; :meth:`start` hands it the
        attempt's own torchrun arguments, and later ones are armed for ``command``."""
        self.command, self.log = list(command), log

    def arm(self, env: dict[str, str], budget_left: bool) -> None:
        """Pre-spawn the next attempt's job root while this one runs (or while a spare waits for a rank). Not when
        this attempt's failure would end the run anyway (``budget_left`` False: max_restarts used up)."""
        if budget_left:
            self._spawn(self.command, env, "the next attempt")

    def arm_now(self, argv: list[str], env: dict[str, str]) -> None:
        """A launcher for the attempt about to start with ``argv`` where none waits (the first attempt, or one whose
        launcher was never armed): its ranks are forked from one torch import (``warm_fork``), where a cold
        torchrun's each import it, so the attempt starts sooner even without the head start."""
        self._spawn(argv, env, "this attempt", ready_timeout=JUST_IN_TIME_READY_S)

    def _spawn(self, command: list[str], env: dict[str, str], what: str, ready_timeout: float = ARMED_READY_S) -> None:
        if not self.enabled or self._zygote is not None:
            return
        spec = warm_spec(command, env)
        if spec is None:
            return
        try:
            self._zygote = Zygote(spec, env, warm_imports=self.warm_imports, warm_cuda=self.warm_cuda,
                                  warm_fork=self.warm_fork)
            self._armed = list(command)
            self._ready_timeout = ready_timeout
        except (OSError, subprocess.SubprocessError) as e:
            self.log(f"warm launcher not started ({e}); launching cold")
            return
        self.log(f"warm launcher pid {self._zygote.pid} spawned for {what}")

    def start(self, attempt: int, env: dict[str, str], argv: list[str], log_path: Path,
              tail_lines: int) -> JobProcess | None:
        """This attempt's job root from the waiting launcher, running ``argv`` (the command with its resume
        placeholders filled); None: launch cold."""
        zygote, self._zygote = self._zygote, None
        if zygote is None:
            return None
        # The attempt's torchrun args where they differ from those armed (filled placeholders, a spare's pinned rank)
        spec = warm_spec(argv, env) if argv != self._armed else None
        if argv != self._armed and spec is None:  # never run the armed arguments for another command (a pinned rank)
            zygote.discard()
            self.log(f"attempt {attempt}: the command is not the one warm launcher pid {zygote.pid} was armed for, "
                     "and not a torchrun it can take; launching cold")
            return None
        try:
            job = zygote.start(spec.args if spec is not None else None, env, os.getcwd(), log_path, tail_lines,
                               ready_timeout=self._ready_timeout)
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the cold launch still can
            zygote.discard()
            self.log(f"attempt {attempt}: warm launcher pid {zygote.pid} failed to start ({e}); launching cold")
            return None
        if job is None:
            said = [line for line in zygote.output_left.splitlines() if line.strip()]
            self.log(f"attempt {attempt}: warm launcher pid {zygote.pid} not usable (exit {zygote.popen.returncode}"
                     f"{': ' + said[-1].strip() if said else ''}); launching cold")
        else:
            age = time.monotonic() - zygote.spawned
            self.log(f"attempt {attempt}: started by the warm launcher (pid {job.pid}, spawned {age:.1f}s ago)")
        return job

    def discard(self) -> None:
        """No next attempt (or rlsup is ending): the waiting launcher goes."""
        zygote, self._zygote = self._zygote, None
        if zygote is not None:
            zygote.discard()
