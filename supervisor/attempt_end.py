"""How an attempt ended: the :class:`AttemptResult` record and the rules that classify an exit.

One place for the rules, so the run loop, the multi-node engine and the fast rank-death path
(:mod:`supervisor.rank_deaths`) describe an ending the same way: a launcher's exit code, torchrun's
"Root Cause" report (a SIGKILLed worker hides behind torchrun's own exit 1), a signal, an OOM kill (a
SIGKILL while the kernel's OOM-kill count rose).
"""

from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass, field

from supervisor.lifecycle import EndReason
from supervisor.rank_deaths import RankDeath


@dataclass
class AttemptResult:
    """How one attempt ended."""

    attempt: int
    reason: EndReason
    exit_code: int | None = None
    signal: str | None = None
    rank: int | None = None
    pid: int | None = None
    detail: str = ""
    stacks: dict[str, str] = field(default_factory=dict)
    last_step: int | None = None
    output_tail: list[str] = field(default_factory=list)
    ended: float = field(default_factory=time.monotonic)
    verdict: str = ""  # the stacks grouped (supervisor.stack_groups), when stacks were taken
    suspect_ranks: list[int] = field(default_factory=list)
    suspect_nodes: list[str] = field(default_factory=list)


_TORCHRUN_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")
_TORCHRUN_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank")


_AGENT_FAILED = re.compile(r"failed \(exitcode:\s*(-?\d+)\)\s*local_rank:\s*(\d+)\s*\(pid:\s*(\d+)\)")


def torchrun_root_cause(lines: list[str]) -> tuple[int, int, int] | None:
    """(rank, exit code, pid) of the first failed worker, from torchrun's "Root Cause" report or,
    for launchers that print only the agent's line (NVRx ft_launcher), ``failed (exitcode: -9) local_rank: R``."""
    rank = None
    for line in lines[next((i for i, l in enumerate(lines) if "Root Cause" in l), len(lines)):]:
        if (m := _TORCHRUN_RANK.search(line)) is not None:
            rank = int(m.group(1))
        elif (m := _TORCHRUN_EXIT.search(line)) is not None and rank is not None:
            return rank, int(m.group(1)), int(m.group(2))
    for line in lines:
        if (m := _AGENT_FAILED.search(line)) is not None:
            return int(m.group(2)), int(m.group(1)), int(m.group(3))
    return None


def classify_exit(attempt: int, code: int, *, tail: list[str], last_step: int | None, job_pid: int,
                  first_dead: tuple[int, int] | None, oom_rose: bool,
                  stop_reason: EndReason | None, finished: str | None = None) -> AttemptResult:
    """The job root exited with ``code`` (negative: a signal). ``stop_reason``: rlsup had asked it to
    stop (STOPPED or PREEMPTED); ``first_dead``: (rank, pid) of a rank seen gone before the exit;
    ``finished``: the line in which the trainer said its run is done (a progress preset's ``done``)."""
    if code == 0 and stop_reason is None:
        return AttemptResult(attempt, EndReason.SUCCESS, 0, last_step=last_step, output_tail=tail)
    if finished is not None and stop_reason is None and code > 0:
        return AttemptResult(attempt, EndReason.SUCCESS, code, last_step=last_step, output_tail=tail,
                             detail=f"exit code {code} after the trainer said it finished: {finished[:200]!r}")
    if stop_reason is not None:
        return AttemptResult(attempt, stop_reason, code, last_step=last_step, output_tail=tail)
    result = AttemptResult(attempt, EndReason.EXIT_CODE, code, last_step=last_step, output_tail=tail)
    if first_dead is not None:
        result.rank, result.pid = first_dead
    root = torchrun_root_cause(tail)
    if root is not None:  # torchrun hides the worker's fate behind its own exit 1; its report has it
        result.rank, worker_code, result.pid = root
        if worker_code < 0:
            result.signal, result.reason = signame(-worker_code), EndReason.SIGNAL
    if code < 0:
        result.signal = signame(-code)
        result.reason = EndReason.SIGNAL
        result.pid = result.pid or job_pid
    if result.signal == "SIGKILL" and oom_rose:
        result.reason = EndReason.OOM
    result.detail = f"exit code {code}" + (f", {result.signal}" if result.signal else "") + \
        (f" (rank {result.rank}, pid {result.pid})" if result.rank is not None else "")
    return result


def from_rank_death(attempt: int, death: RankDeath, *, tail: list[str], last_step: int | None,
                    oom_rose: bool) -> AttemptResult:
    """A rank died while its launcher still ran: the attempt ends now, classified by the rank's status."""
    reason = EndReason.SIGNAL if death.signal else EndReason.EXIT_CODE
    if death.signal == "SIGKILL" and oom_rose:
        reason = EndReason.OOM
    return AttemptResult(attempt, reason, death.exit_code, signal=death.signal, rank=death.rank, pid=death.pid,
                         detail=f"{death.describe()}; attempt ended without waiting for the launcher",
                         last_step=last_step, output_tail=tail)


def signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"
