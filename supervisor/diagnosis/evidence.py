"""What was seen of an attempt's end, gathered before it is classified once
(:func:`supervisor.diagnosis.outcome.classify`): how it ended (an exit, a rank's death, a hang, a stop,
another node, a straggler, a failed health check, no launch), where to read the GPU's word on it, the
processes still stuck after the kill, and the Flight Recorder's verdicts.

Every record is frozen: the run loop and the watch add evidence by building a new record, never by
rewriting the outcome.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from supervisor.diagnosis.gpu_failures import KMSG, Probe, probe_node
from supervisor.diagnosis.rank_deaths import RankDeath
from supervisor.lifecycle import EndReason

if TYPE_CHECKING:
    from supervisor.diagnosis.stragglers import StragglerReport
    from supervisor.diagnosis.unkillable import StuckProcess


@dataclass(frozen=True)
class GpuEvidence:
    """Where the GPU's word on the attempt is read, when it is classified: the kernel log (from ``since``,
    the attempt's start, ``time.monotonic()``; None: not read) and NVML's probe of this node's GPUs."""

    since: float | None
    kernel_log: str | os.PathLike | None = KMSG
    probe: Probe = probe_node


@dataclass(frozen=True)
class ExitSeen:
    """The job's root exited with ``code`` (negative: a signal). ``stop_reason``: rlsup had asked it to stop;
    ``first_dead``: (rank, pid) of a rank seen gone before; ``finished``: the trainer's "done" line;
    ``error_file``: where the launcher may have written torchelastic's report."""

    code: int
    job_pid: int
    first_dead: tuple[int, int] | None = None
    finished: str | None = None
    stop_reason: EndReason | None = None
    error_file: str | os.PathLike | None = None


@dataclass(frozen=True)
class HangSeen:
    """A rank (or the job's output) went silent past its timeout (``reason``: hang, startup or save
    timeout); the stacks taken before the kill."""

    reason: EndReason
    detail: str
    rank: int | None = None
    pid: int | None = None
    stacks: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StopSeen:
    """rlsup asked the job to stop (``reason``: stopped or preempted); ``code``: its exit, None when it
    was killed after ``stop_grace`` (then its stacks were taken)."""

    reason: EndReason
    code: int | None
    stacks: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EndedElsewhere:
    """The attempt ended without this node's job failing: another node ended it (``peer_failure``; ``resized``:
    node 0, to grow the job back) or it was never launched (``reason``); ``detail`` says why."""

    reason: EndReason
    detail: str


@dataclass(frozen=True)
class HealthFailed:
    """``pre_launch_check`` found the node unhealthy; nothing was launched."""

    detail: str
    output_tail: tuple[str, ...] = ()


Ending = Union[ExitSeen, RankDeath, HangSeen, StopSeen, EndedElsewhere, HealthFailed, "StragglerReport"]


@dataclass(frozen=True)
class FlightEvidence:
    """The Flight Recorder's verdict on a hang: its text and the ranks (and nodes) it names. ``missing``:
    why no verdict came across nodes (the text is then empty)."""

    text: str = ""
    suspects: tuple[int, ...] = ()
    suspect_nodes: tuple[str, ...] = ()
    missing: str = ""


@dataclass(frozen=True)
class AttemptEvidence:
    """Everything seen of one attempt's end. ``node``: this machine's name (for verdicts and suspects);
    ``flight``: this node's Flight Recorder verdict, ``shared_flight``: the one across nodes;
    ``stuck``: processes still alive ``kill_grace`` seconds after the attempt's SIGKILL."""

    attempt: int
    ending: Ending
    node: str = ""
    last_step: int | None = None
    output_tail: tuple[str, ...] = ()
    oom_rose: bool = False
    gpu: GpuEvidence | None = None
    flight: FlightEvidence | None = None
    shared_flight: FlightEvidence | None = None
    stuck: tuple["StuckProcess", ...] = ()
    kill_grace: float = 0.0
    ended: float = field(default_factory=time.monotonic)
