"""What one run leaves in its state directory: ``state.json`` (the lifecycle state and its details),
``incidents.jsonl`` (one line per ended attempt) and the attempts' directories (output, heartbeats).

The run loop says what happened; this module writes it down and tells the observer (metrics) of state
changes and downtime. Every state change goes through :func:`supervisor.lifecycle.check_transition`.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from rlsup_format import state_files
from supervisor.diagnosis.outcome import AttemptResult
from supervisor.run.file_versions import LeftTorn
from supervisor.run.incidents import Incident, JobState, append_incident, publish_state, read_state, write_state
from supervisor.lifecycle import FINAL, Action, EndReason, JobStatus, check_transition
from supervisor.observer import Observer
from supervisor.tiers.resume import ResumePoint

KEEP_ATTEMPT_DIRS = 10
log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What ``rlsup run`` ended with."""

    exit_code: int
    status: JobStatus
    attempts: int
    incidents: list[Incident]


def incident_for(result: AttemptResult, action: Action, left_torn: Sequence[LeftTorn] = (),
                 reached: int | None = None) -> Incident:
    """The incident line of an ended attempt: its outcome (copied here, and only here) and what rlsup did about
    it; ``left_torn``: the single-file checkpoints the attempt left torn with no version to put back (the next
    attempt meets them); ``reached``: the step the attempt reached as its progress was judged
    (:func:`supervisor.run.progress_rule.step_reached`), where it was (default: the outcome's last step)."""
    return Incident(time=time.time(), attempt=result.attempt, reason=result.reason, exit_code=result.exit_code,
                    signal=result.signal, rank=result.rank, pid=result.pid, detail=result.detail,
                    output_tail=list(result.output_tail), stacks=dict(result.stacks),
                    last_step=result.last_step if reached is None else reached,
                    action=action, verdict=result.verdict, suspect_ranks=list(result.suspect_ranks),
                    suspect_nodes=list(result.suspect_nodes), fr_verdict=result.fr_verdict,
                    left_torn=[{"file": str(t.live), "torn": t.why, "no_version": t.no_version} for t in left_torn])


class RunRecord:
    """One run's ``state.json``, incidents and attempt directories under ``state_dir``.

    ``resume_known`` tells whether the step an attempt resumed from is known (an incident says
    "unknown" where it is not: :meth:`supervisor.run.checkpoint_sight.CheckpointSight.resume_known`)."""

    def __init__(self, state_dir: Path, command: Sequence[str], observer: Observer,
                 resume_known: Callable[[ResumePoint | None], bool]) -> None:
        self.state_dir, self.observer, self.resume_known = state_dir, observer, resume_known
        self.state = JobState(JobStatus.INIT, 0, os.getpid(), list(command), time.time())
        self.incidents: list[Incident] = []

    # ------------------------------------------------------------ state.json

    def set_state(self, status: JobStatus, *, attempt: int | None = None, resume: ResumePoint | None = None,
                  job_pid: int | None = None, exit_code: int | None = None, last_step: int | None = None) -> None:
        """Move to ``status`` (IllegalTransition if the lifecycle table does not allow it), with its details."""
        self.state.state = check_transition(self.state.state, status)
        self.update_state(attempt=attempt, resume=resume, job_pid=job_pid, exit_code=exit_code, last_step=last_step,
                          changed=True)

    def update_state(self, *, attempt: int | None = None, resume: ResumePoint | None = None,
                     job_pid: int | None = None, exit_code: int | None = None, last_step: int | None = None,
                     changed: bool = False) -> None:
        """Details of the current state (state.json); the observer hears of state changes only. ``last_step``:
        the step the attempt reached as it ended (its last beats, read after the last poll)."""
        if last_step is not None:
            self.state.last_step = last_step
        if attempt is not None:
            self.state.attempt = attempt
            self.state.resume_step = resume.step if resume else None
            self.state.resume_dir = str(resume.path) if resume else None
            self.state.resume_tier = resume.tier if resume else None
        if job_pid is not None:
            self.state.job_pid = job_pid
        if exit_code is not None:
            self.state.exit_code = exit_code
        write_state(self.state_dir, self.state)
        if changed:
            self.observer.state(self.state.state.value)

    def world_nodes(self, nodes: int, job_nodes: int) -> None:
        """The agreed attempt runs on ``nodes`` of the job's ``job_nodes`` nodes: written to state.json (``rlsup
        status`` says when the job runs shrunk) and told to the observer (metrics). Several nodes only."""
        if (self.state.world_nodes, self.state.job_nodes) != (nodes, job_nodes):
            self.state.world_nodes, self.state.job_nodes = nodes, job_nodes
            publish_state(self.state_dir, self.state)
        self.observer.world_nodes(nodes, job_nodes)

    def heartbeats(self, timeout_s: float, last_step: int | None, origin: Any = None) -> bool:
        """What the running attempt's heartbeats say; True when ``last_step`` moved (state.json is then
        published, so ``rlsup status`` follows the steps, and how the timeout was reached: ``origin``, a
        :class:`supervisor.diagnosis.hang_detector.TimeoutOrigin`)."""
        self.state.heartbeat_timeout_s = timeout_s
        how = None if origin is None else {"source": origin.source, "intervals": origin.intervals,
                                           "stalls": origin.stalls, "text": origin.text}
        if self.state.heartbeat_timeout_origin != how:
            self.state.heartbeat_timeout_origin = how
            if self.state.last_step == last_step:
                publish_state(self.state_dir, self.state)
        if self.state.last_step == last_step:
            return False
        self.state.last_step = last_step
        publish_state(self.state_dir, self.state)
        return True

    def predecessor(self) -> dict[str, Any] | None:
        """The state a previous rlsup left, or None (none, or it ended: a final state)."""
        prev = read_state(self.state_dir)
        return None if not prev or prev.get("state") in FINAL else prev

    # ------------------------------------------------------------ incidents

    def add(self, incident: Incident, downtime: float | None = None, resume: ResumePoint | None = None) -> None:
        """Append ``incident``; with ``downtime`` (the next attempt has started) the time lost and where it
        resumed from. Without, nothing followed it (rlsup gave up or stopped): it claims no resume, and
        ``resume_known`` stays None."""
        incident.downtime_s = None if downtime is None else round(downtime, 3)
        if resume is not None:
            incident.resumed_from, incident.resumed_step = str(resume.path), resume.step
            incident.resumed_tier = resume.tier
        if downtime is not None:
            incident.resume_known = self.resume_known(resume)
        append_incident(self.state_dir, incident)
        self.incidents.append(incident)
        if downtime is not None:
            self.observer.downtime(downtime)

    @staticmethod
    def lost(prev: dict[str, Any], ended: str) -> Incident:
        """The incident of a previous rlsup that died while its job ran (``prev``: the state it left)."""
        return Incident(time=time.time(), attempt=int(prev.get("attempt", 0)), reason=EndReason.SUPERVISOR_LOST,
                        action=Action.RESTART, last_step=prev.get("last_step"),
                        detail=f"rlsup pid {prev.get('pid')} died while the job was {prev.get('state')}{ended}")

    # ------------------------------------------------------------ attempt directories

    def fresh_attempt_dir(self, attempt: int) -> Path:
        """A fresh directory for ``attempt`` (:func:`rlsup_format.state_files.attempt_path`: its output and
        heartbeats), whatever an earlier run left there; only the newest ``KEEP_ATTEMPT_DIRS`` are kept."""
        attempt_dir = state_files.attempt_path(self.state_dir, attempt)
        if attempt_dir.exists():
            shutil.rmtree(attempt_dir, ignore_errors=True)
        (attempt_dir / state_files.HEARTBEATS).mkdir(parents=True)
        for old in sorted((self.state_dir / state_files.ATTEMPTS).glob(state_files.ATTEMPT_GLOB))[:-KEEP_ATTEMPT_DIRS]:
            shutil.rmtree(old, ignore_errors=True)
        return attempt_dir

    # ------------------------------------------------------------ the end

    def result(self, code: int, status: JobStatus, attempt: int, why: str = "") -> RunResult:
        log.info(f"{status.value} after {attempt + 1} attempt(s); exit {code}" + (f" ({why})" if why else ""))
        return RunResult(code, status, attempt + 1, self.incidents)
