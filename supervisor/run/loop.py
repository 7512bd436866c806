"""The supervision loop of ``rlsup run``: launch, watch, classify, clean up, back off, relaunch.

The loop is short on purpose; each step is a small method a subclass (the multi-node engine, tests)
can override: :meth:`Supervisor.choose_resume`, :meth:`launch`, :meth:`watch`, :meth:`cleanup`,
:meth:`decide`, :meth:`record_incident`. Its parts live with their own code: the settings it reads
(:mod:`supervisor.run.settings`), state.json and the incidents (:mod:`supervisor.run.record`), the watch
of a running attempt (:mod:`supervisor.run.attempt_watch`), stop and preemption signals
(:mod:`supervisor.stop_request`) and the warm launcher (:mod:`supervisor.launch.warm_start`). Everything it
does to processes goes through a :class:`~supervisor.processes.job.ProcessLayer` (a fake one in the
in-process tests, tests/test_run_loop.py).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Sequence

from rlsup_format.manifest import latest_valid
from supervisor import exit_codes, log as rlsup_log
from supervisor.diagnosis.outcome import ERROR_FILE_ENV, AttemptResult, error_file_for, with_hang_gpu_failure
from supervisor.run.progress_rule import step_reached
from supervisor.bounded_calls import BoundedCalls
from supervisor.run.attempt_watch import AttemptWatch
from supervisor.run.checkpoint_sight import CheckpointSight
from supervisor.config import SupervisorConfig
from supervisor.diagnosis.gpu_failures import KMSG, probe_node
from supervisor.diagnosis.hang_detector import LEARNED_FILE, AutoTimeout, HangSettings
from supervisor.membership import node_name
from supervisor.run.incidents import Incident, JobState
from supervisor.job_identity import ENV_JOB_ID, JobIdentity, job_identity
from supervisor.lifecycle import EXCLUDES_NODE, Action, EndReason, JobStatus
from supervisor.observer import Observer
from supervisor.processes.job import JobProcess, ProcessLayer
from supervisor.diagnosis.step_reports import attach as attach_progress
from supervisor.run.restart_policy import RestartPolicy, give_up_code
from supervisor.run.record import RunRecord, RunResult, incident_for
from supervisor.run.settings import RunSettings
from supervisor.stop_request import StopRequest
from supervisor.tiers.memory_tier import MemoryTier
from supervisor.tiers.persistent import PersistentTier
from supervisor.tiers.resume import ResumePoint, choose_resume, repair_tracker
from supervisor.launch.warm_start import WarmStarts

log = logging.getLogger(__name__)


def launch_env(settings: RunSettings) -> dict[str, str]:
    """Every attempt's environment before its own variables (attempt, directories, resume step, memory tier).
    All of it that acts at interpreter start or import is set here, so a warm launcher armed before any attempt
    (a waiting spare's, :mod:`supervisor.cluster.spare_run`) starts its ranks as the attempt's own would start."""
    from supervisor.diagnosis.flight_recorder import job_env as flight_recorder_env

    env = dict(os.environ)
    env.update(flight_recorder_env(env))  # PyTorch's Flight Recorder on, unless the user sized it (0: off)
    if settings.progress or settings.progress_regex:  # progress is read from the output: as printed
        env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class AttemptAbandoned(Exception):
    """Raised by :meth:`Supervisor.prepare`: the attempt is over before launch (another node ended it);
    nothing is launched, and it counts as a failed attempt (``peer_failure``) for the restart policy."""


class Supervisor:
    """Runs ``command`` under supervision with ``cfg``; call :meth:`run` once."""

    keeps_file_versions = True  #: single-file versions (several nodes would fight over one shared directory)

    def __init__(self, cfg: SupervisorConfig, command: Sequence[str], observer: Observer | None = None,
                 job: JobIdentity | None = None, processes: ProcessLayer | None = None, *,
                 node_rank: int = 0, num_nodes: int = 1) -> None:
        self.job = job or job_identity(cfg.job_name, cfg.checkpoint_dir, multi_node=False)
        self.cfg = cfg.resolved()  # read only to build the components' settings (here and in subclasses)
        self.settings = RunSettings.from_config(self.cfg)
        self.command = list(command)
        self.state_dir, self.checkpoint_dir = self.settings.state_dir, self.settings.checkpoint_dir
        self.observer = observer or Observer()
        self.processes = processes or ProcessLayer()
        self.policy = RestartPolicy.from_config(self.cfg)
        hang = HangSettings.from_config(self.cfg)
        self.stop = StopRequest(self.settings.preempt_signal)
        self.warm = WarmStarts(self.command, self.settings.warm_launcher, self.settings.warm_imports,
                               self._log, self.settings.warm_cuda)  # the next attempt's root, spawned while this one runs
        self.node_name = node_name()  # what incidents, metrics and the SLURM exclude list call this machine
        self.persistent = PersistentTier.from_config(self.cfg, node_rank, self.job.id)  # None: persistent_dir empty
        self.memory = MemoryTier.from_config(self.cfg, self.checkpoint_dir, self.job.id, node_rank, num_nodes)
        if self.persistent is not None:
            self.observer.tier("persistent", self.persistent.stalled)
        self.sight = CheckpointSight(self.cfg, self.checkpoint_dir, self._log,  # single-file, unreadable, steps
                                     keep_file_versions=self.keeps_file_versions)
        self.record = RunRecord(self.state_dir, self.command, self.observer, self.sight.resume_known)
        learned = AutoTimeout.from_settings(hang, self.state_dir / LEARNED_FILE, self.command)  # across rlsup restarts
        self.watcher = AttemptWatch(self.settings, hang, learned, self.processes, self.stop,
                                    self.record, self.sight, self.observer, self.node_name, self.peer_ended,
                                    self.refresh_checkpoint_metric)
        self.checkpoint_reads = BoundedCalls(f"reading the checkpoint directory {self.checkpoint_dir}", 10.0,
                                             forked=True)  # a read stuck in a hung mount never holds rlsup's exit
        self.kernel_log: str | os.PathLike | None = KMSG  # a hang's lost GPU (with_hang_gpu_failure); tests: a file
        self.gpu_probe = probe_node  # NVML on this node's GPUs, to tie a hang's Xid to the job (tests: a stand-in)

    @property
    def state(self) -> JobState:
        """What ``state.json`` says now."""
        return self.record.state

    @property
    def incidents(self) -> list[Incident]:
        """This run's incidents so far."""
        return self.record.incidents

    # ------------------------------------------------------------ the loop

    def run(self) -> RunResult:
        previous = self.stop.install()
        try:
            return self._run()
        finally:
            self.warm.discard()  # every way out, exceptions included: no unused launcher outlives rlsup
            self.processes.release_attempts()  # nothing recorded outlives the run; the guardian goes
            self.stop.restore(previous)  # a second Supervisor in this process starts clean

    def request_stop(self, signum: int, preempted: bool = False) -> None:
        """Stop the run (from any thread but a signal handler): the job is asked to save and exit; rlsup
        exits 128+signal, or REQUEUE when ``preempted``."""
        self.stop.ask(signum, preempted)

    def _run(self) -> RunResult:
        self._start()
        attempt = self.first_attempt()
        pending: tuple[Incident, float] | None = None  # last failure, recorded once the next attempt starts
        while True:
            rlsup_log.set_context(attempt=attempt)  # rlsup's lines from here on: a<attempt>
            self.record.set_state(JobStatus.STARTING, attempt=attempt)
            sick = self.check_health(attempt)
            if sick is not None:
                return self._unhealthy(attempt, sick, pending)
            try:
                resume = self.prepare(attempt)
            except AttemptAbandoned as e:
                self._log(f"attempt {attempt}: not launched: {e}")
                if pending is not None:
                    self.record_incident(pending[0])
                why = self.stop.reason if self.stop.asked else EndReason.PEER_FAILURE  # stopped in a wait: a stop
                resume, result = None, AttemptResult(attempt, why, None, detail=str(e))
            else:
                result = self._launch_and_watch(attempt, resume, pending)
            if result.reason == EndReason.SUCCESS:  # the real exit code (non-zero after a trainer's done line)
                self.record.set_state(JobStatus.SUCCEEDED, exit_code=result.exit_code or 0, last_step=result.last_step)
                return self._finish(exit_codes.OK, JobStatus.SUCCEEDED, attempt, result.detail)
            if result.reason in (EndReason.STOPPED, EndReason.PREEMPTED):
                self.record_incident(incident_for(result, Action.STOP))
                return self._stopped(attempt)
            if result.reason in EXCLUDES_NODE:  # GPU broke, or a process in D: no restart here (gpu_failures, unkillable)
                return self._node_lost(attempt, result)
            incident, delay = self.decide(attempt, result, resume)
            if delay is None:
                code, why = give_up_code(incident.action, result, self.policy.settings.max_no_progress_attempts)
                self._log(why)
                self.record.set_state(JobStatus.GAVE_UP, exit_code=code, last_step=result.last_step)
                return self._finish(code, JobStatus.GAVE_UP, attempt)
            pending = (incident, result.ended)
            self.record.set_state(JobStatus.BACKOFF)
            if self.stop.wait(delay, self.settings.poll_interval):
                self.record_incident(incident)
                return self._stopped(attempt)
            attempt = self.next_attempt(attempt)

    def _start(self) -> None:
        """Before the first attempt: the directories, and the tiers' and the sight's threads."""
        self.processes.become_subreaper()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if not self.sight.default_dir or self.persistent is not None or self.memory is not None:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)  # given (or a tier's): a stray default is not made
        if self.persistent is not None:
            self.persistent.start(self.checkpoint_dir)
        if self.memory is not None:
            self.memory.start()
        self.sight.start()

    def _launch_and_watch(self, attempt: int, resume: ResumePoint | None,
                          pending: tuple[Incident, float] | None) -> AttemptResult:
        self.record.update_state(attempt=attempt, resume=resume)
        started = time.monotonic()  # the kernel's GPU faults from here on are this attempt's
        job, hb_dir = self.launch(attempt, resume)
        if pending is not None:
            self.record_incident(pending[0], downtime=time.monotonic() - pending[1], resume=resume)
        self.record.set_state(JobStatus.RUNNING, job_pid=job.pid)
        result = with_hang_gpu_failure(self.watch(job, hb_dir, attempt), since=started, kernel_log=self.kernel_log,
                                       probe=self.gpu_probe)
        self.cleanup(job, result)
        return result

    def decide(self, attempt: int, result: AttemptResult, resume: ResumePoint | None) -> tuple[Incident, float | None]:
        """A failed attempt: its incident, and the delay before the next one (None: give up, recorded now)."""
        self.record.set_state(JobStatus.FAILED)
        self.attempt_failed(attempt, result)
        newest = self.progress_marker()
        result.last_step = step_reached(result.last_step, resume.step if resume else None, newest)
        progress = self.sight.judge(result.last_step, newest, resume)  # supervisor.run.progress_rule
        decision = self.policy.decide(result.exit_code, progress.progressed)
        self.observer.attempt_failed(result.reason, result.last_step)
        incident = incident_for(result, decision.action, self.sight.left_torn)
        if not decision.restart:
            self.give_up(f"node gave up after attempt {attempt}: {decision.action}")
            self.record_incident(incident)
            return incident, None
        self._log(f"attempt {attempt} failed ({result.reason}{': ' + result.detail if result.detail else ''}); "
                  f"restarting in {decision.delay_s:.1f}s")
        return incident, decision.delay_s

    def _stopped(self, attempt: int) -> RunResult:
        """rlsup was asked to stop (exit 128+signal) or preempted (exit for requeue). A job that exited
        before rlsup acted on the signal still passes through STOPPING (the table has no shortcut)."""
        if self.state.state == JobStatus.RUNNING:
            self.record.set_state(JobStatus.STOPPING)
        status = JobStatus.PREEMPTED if self.stop.preempted else JobStatus.STOPPED
        code = self.stop.exit_code()
        self.record.set_state(status, exit_code=code)
        return self._finish(code, status, attempt)

    def _node_lost(self, attempt: int, result: AttemptResult) -> RunResult:
        """The attempt failed with this node's hardware broken (:data:`EXCLUDES_NODE`): tell the other nodes
        and stop as a node failing pre_launch_check does (exit UNHEALTHY, the node in unhealthy_nodes)."""
        self.attempt_failed(attempt, result)
        self.observer.attempt_failed(result.reason, result.last_step)
        self.give_up(f"node gave up after attempt {attempt}: {Action.EXCLUDE_NODE} ({result.reason})")
        result.verdict = result.verdict or f"node {self.node_name} is unhealthy: {result.detail}"
        result.suspect_nodes = [*result.suspect_nodes, self.node_name]
        self._log(f"attempt {attempt} failed ({result.reason}: {result.detail}); not restarting on this node")
        return self._unhealthy(attempt, result, None)

    def _unhealthy(self, attempt: int, result: AttemptResult, pending: "tuple[Incident, float] | None") -> RunResult:
        """Stop: record the node for the requeue's ``--exclude`` and exit UNHEALTHY."""
        from supervisor.run.node_health import record_unhealthy

        if pending is not None:
            self.record_incident(pending[0])
        self.record_incident(incident_for(result, Action.EXCLUDE_NODE))
        path = record_unhealthy(self.state_dir, self.node_name)
        self._log(f"node {self.node_name} recorded in {path}; requeue the job without it")
        self.observer.suspect(self.node_name, "health")
        self.record.set_state(JobStatus.FAILED)
        self.record.set_state(JobStatus.GAVE_UP, exit_code=exit_codes.UNHEALTHY)
        return self._finish(exit_codes.UNHEALTHY, JobStatus.GAVE_UP, attempt)

    def _finish(self, code: int, status: JobStatus, attempt: int, why: str = "") -> RunResult:
        self.warm.discard()  # no next attempt: do not keep a launcher alive through the final copy
        if self.memory is not None:  # the newest memory step to disk first (the persistent flush reads disk)
            self.memory.finish(remove=status == JobStatus.SUCCEEDED, timeout=self.settings.stop_grace)
        if self.persistent is not None:  # the last checkpoint, whatever the cadence; the tier logs the copy
            self.persistent.flush(self.settings.stop_grace)
        self.sight.stop()
        return self.record.result(code, status, attempt, why)

    # ------------------------------------------------------------ steps (overridable)

    def check_health(self, attempt: int) -> AttemptResult | None:
        """Run ``pre_launch_check`` (if set); the failed attempt it makes, or None when healthy."""
        from supervisor.run.node_health import check_node

        sick = check_node(self.settings.pre_launch_check, self.settings.pre_launch_timeout, attempt, self.node_name,
                          self.command)
        if sick is not None:
            self._log(f"attempt {attempt}: {sick.verdict}")
        return sick

    def first_attempt(self) -> int:
        """0, or the attempt after the one a previous rlsup was running when it died (SIGKILL, OOM).
        What a dead predecessor's attempt left running (its cgroup, or its recorded sessions and pids
        whose start times still match) is ended first; then this run's attempts are guarded."""
        prev = self.record.predecessor()
        leftovers = self.processes.end_predecessor(self.state_dir)
        ended = "" if leftovers is None else "; nothing of its attempt was left running" if not leftovers[1] \
            else f"; ended what its attempt left: {', '.join(map(str, leftovers[1]))}"
        if leftovers and leftovers[1]:
            self._log(f"a previous rlsup (pid {leftovers[0]}) died{ended}")
        self.processes.guard_attempts(self.state_dir)
        if prev is None or self.processes.pid_exists(int(prev.get("pid", 0))):
            return 0
        lost = self.record.lost(prev, ended)
        self.record_incident(lost)
        self._log(f"a previous rlsup died during attempt {lost.attempt}; continuing with attempt {lost.attempt + 1}")
        return lost.attempt + 1

    def next_attempt(self, attempt: int) -> int:
        return attempt + 1

    def record_incident(self, incident: Incident, downtime: float | None = None,
                        resume: ResumePoint | None = None) -> None:
        """Record an ended attempt (:meth:`supervisor.run.record.RunRecord.add`); with ``downtime``, once the
        next attempt has started from ``resume``."""
        self.record.add(incident, downtime, resume)

    def prepare(self, attempt: int) -> ResumePoint | None:
        """Everything before launch; returns the checkpoint to resume from (fetched from the
        persistent tier when that holds a newer valid step than the local directory)."""
        if (self.persistent is not None or self.memory is not None) and self.settings.resume:
            from supervisor.tiers.selection import choose_across_tiers

            point = choose_across_tiers(self.checkpoint_dir, self.persistent, self.settings.checkpoint_layout,
                                        job=self.job.id, memory=self.memory)
            if self.memory is not None:
                self.memory.protect(point.path if point is not None else None)
            if point is not None:
                self.observer.checkpoint(point.step, point.path.stat().st_mtime)
        else:
            self.sight.before_choosing()
            point = self.choose_resume()
        if point is not None and self.settings.repair_tracker:
            point = repair_tracker(self.checkpoint_dir, point, self._log)
        return point

    def peer_ended(self, attempt: int) -> str | None:
        """Polled while the job runs: a reason when another node ended this attempt (single node: never)."""
        return None

    def attempt_failed(self, attempt: int, result: "AttemptResult") -> None:
        """This node's attempt failed (tell the other nodes)."""

    def give_up(self, reason: str) -> None:
        """This node stops restarting (tell the other nodes)."""

    def progress_marker(self) -> int | None:
        """Newest valid checkpoint step, to tell whether a failed attempt made progress."""
        point = self.choose_resume()
        in_memory = self.memory.newest_valid(full=False) if self.memory is not None and self.settings.resume else None
        if in_memory is not None and (point is None or in_memory[0] > point.step):
            return in_memory[0]
        return point.step if point is not None else None

    def choose_resume(self) -> ResumePoint | None:
        point, chosen = self._resume_point()
        if chosen is not None:  # a layout's step (the single-file fallback sets no metric)
            self.observer.checkpoint(chosen.step, chosen.path.stat().st_mtime)
        return point

    def _resume_point(self) -> tuple[ResumePoint | None, ResumePoint | None]:
        """:meth:`choose_resume` without the metric, safe in a forked child (no lock of the observer's): the point,
        and the same when a layout chose it (None for the single-file fallback, which names no step)."""
        if not self.settings.resume:
            return None, None
        point = choose_resume(self.checkpoint_dir, self.settings.checkpoint_layout, self.job.id)
        if point is None:
            return self.sight.resume_fallback(), None
        return point, point

    def refresh_checkpoint_metric(self) -> None:
        """A save just ended: report the newest checkpoint, read off the run loop's thread
        (:mod:`supervisor.bounded_calls`: a hung checkpoint mount must not stop hang detection)."""
        found = self.checkpoint_reads.call(self._newest_checkpoint, None)
        if found is not None:
            self.observer.checkpoint(*found)

    def _newest_checkpoint(self) -> tuple[int, float] | None:
        """(step, mtime) of the newest checkpoint, read in a forked child (its value is all that comes back; the
        parent sets the metric: the observer's locks may be held at the fork). Sizes only for rlsup's own
        layout, so the supervisor does not re-read every byte the trainer just wrote (restart selection checks
        all)."""
        if self.settings.checkpoint_layout in ("rlsup", "auto"):
            result = latest_valid(self.checkpoint_dir, full=False)
            if result is not None and result.step is not None:
                return result.step, result.path.stat().st_mtime
        point = self._resume_point()[0]
        return (point.step, point.path.stat().st_mtime) if point is not None and point.step is not None else None

    def attempt_env(self, attempt: int, resume: ResumePoint | None, hb_dir: Path) -> dict[str, str]:
        env = launch_env(self.settings)
        from supervisor.tiers.memory_tier import ENV_NAMES as MEMORY_ENV

        for key in ("RLSUP_RESUME_DIR", "RLSUP_RESUME_STEP", *MEMORY_ENV):
            env.pop(key, None)
        if self.memory is not None:
            env.update(self.memory.env())  # the job's memory tier: ranks save there (trainer_hooks.memory_tier)
        env.update({
            "RLSUP_RESTART_COUNT": str(attempt),
            "RLSUP_CHECKPOINT_DIR": str(self.checkpoint_dir),
            "RLSUP_HEARTBEAT_DIR": str(hb_dir),
            "RLSUP_STATE_DIR": str(self.state_dir),
            "RLSUP_PREEMPT_SIGNAL": self.settings.preempt_signal.name,
            ENV_JOB_ID: self.job.id,
        })
        env.setdefault(ERROR_FILE_ENV, str(error_file_for(hb_dir)))  # torchrun's failure report, unless the user's
        if self.settings.resume:
            # The step every rank must load, or empty for "start fresh": trainer_hooks never picks another
            # step on its own under rlsup (a rank quietly starting over loses the run). Not set with
            # resume: false, where the trainer chooses.
            env["RLSUP_RESUME_DIR"] = str(resume.path) if resume is not None else ""
        if resume is not None and resume.step is not None:
            env["RLSUP_RESUME_STEP"] = str(resume.step)
        return env

    def launch(self, attempt: int, resume: ResumePoint | None) -> tuple[JobProcess, Path]:
        attempt_dir = self.record.attempt_dir(attempt)
        hb_dir = attempt_dir / "heartbeats"
        where = "" if resume is None else f" from {resume.path}" if resume.step is None else \
            f" from step {resume.step} ({resume.path})"
        argv = self.attempt_command(resume)
        # Where the trainer picks its own checkpoint: said, with a torn newest one it would load (bounded: a hung mount)
        note = self.checkpoint_reads.call(lambda: self.sight.launch_note(self.command, resume), "")
        self._log(f"attempt {attempt}: launching {' '.join(argv)}{where}{note}")
        if self.memory is not None and self.settings.resume and (resume is None or resume.step is not None):
            self.memory.supersede(resume.step if resume is not None else None)  # steps of an abandoned timeline
        env = self.attempt_env(attempt, resume, hb_dir)
        tail_lines = self.settings.output_tail_lines
        job = self.warm.start(attempt, env, argv, attempt_dir / "output.log", tail_lines)
        if job is None:
            job = self.processes.start(argv, env, attempt_dir / "output.log", tail_lines)
        attach_progress(self.settings.progress, self.settings.progress_regex, job, hb_dir)
        self.observer.attempt_started(attempt, resume.step if resume else None, known=self.sight.resume_known(resume))
        self.sight.attempt_launched()
        if resume is not None:
            self.observer.resumed_from(resume.tier)
        self.warm.arm(env, self.policy.budget_left())
        return job, hb_dir

    def attempt_command(self, resume: ResumePoint | None) -> list[str]:
        """The launch command with its resume placeholders filled (:mod:`supervisor.run.launch_args`)."""
        from supervisor.run.launch_args import ResumeFill, expand

        return expand(self.command, None if resume is None else ResumeFill(str(resume.path), resume.step))

    def watch(self, job: JobProcess, hb_dir: Path, attempt: int) -> AttemptResult:
        """Poll until the job exits, a rank dies, it hangs, or rlsup is asked to stop
        (:class:`supervisor.run.attempt_watch.AttemptWatch`)."""
        return self.watcher.watch(job, hb_dir, attempt)

    def cleanup(self, job: JobProcess, result: AttemptResult) -> None:
        """Nothing of an attempt may survive it.

        A failed attempt (crash, hang, another node's failure) is killed at once with SIGKILL: a
        half-written step is harmless by design (manifest last), its stacks are already saved, and a
        rank stuck in a collective would only turn SIGTERM into should_stop() and never act on it. What
        is left of a successful, stopped or preempted job gets SIGTERM and ``kill_grace``."""
        graceful = result.reason in (EndReason.SUCCESS, EndReason.STOPPED, EndReason.PREEMPTED)
        killed = job.terminate_tree(self.settings.kill_grace if graceful else 0.0, stuck_after=self.settings.kill_grace)
        if killed:
            self._log(f"attempt {result.attempt}: killed leftover processes {killed}")
        from supervisor.diagnosis.unkillable import unkillable_result

        unkillable_result(result, getattr(job, "stuck", []), self.settings.kill_grace, self._log,
                          self.state_dir / "unkillable.json")

    @staticmethod
    def _log(message: str) -> None:
        """The run loop's own lines, on rlsup's one logging channel (:mod:`supervisor.log`)."""
        log.info(message)


__all__ = ["Supervisor", "AttemptAbandoned", "RunResult", "JobStatus", "launch_env"]
