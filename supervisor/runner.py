"""The supervision loop of ``rlsup run``: launch, watch, classify, clean up, back off, relaunch.

The loop is short on purpose; each step is a small method a subclass (the multi-node engine, tests)
can override: :meth:`Supervisor.choose_resume`, :meth:`launch`, :meth:`watch`, :meth:`cleanup`,
:meth:`decide`. Every state change goes through :func:`supervisor.lifecycle.check_transition`;
everything it does to processes goes through a :class:`~supervisor.process_tree.ProcessLayer`
(a fake one in the in-process tests, tests/test_run_loop.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from supervisor import exit_codes, log as rlsup_log
from supervisor.attempt_end import ERROR_FILE_ENV, AttemptResult, classify_exit, error_file_for, from_rank_death
from supervisor.attempt_progress import step_reached
from supervisor.config import SupervisorConfig
from supervisor.hang_detector import AutoTimeout, HangDetector, HangSettings, HangVerdict
from supervisor.health import node_name
from supervisor.incidents import Incident, JobState, append_incident, publish_state, write_state
from supervisor.job_identity import ENV_JOB_ID, JobIdentity, job_identity
from supervisor.lifecycle import FINAL, Action, EndReason, JobStatus, check_transition
from supervisor.observer import Observer
from supervisor.process_tree import JobProcess, ProcessLayer
from supervisor.progress import attach as attach_progress, registered_ranks
from supervisor.rank_deaths import RankDeathWatch
from supervisor.restart_policy import RestartPolicy, give_up_code
from supervisor.stragglers import StragglerDetector, StragglerWatch
from supervisor.tiers.resume import ResumePoint, choose_resume, repair_tracker
from rlsup_format.heartbeat_record import rank_file_name, request_stop

KEEP_ATTEMPT_DIRS = 10
log = logging.getLogger(__name__)


class AttemptAbandoned(Exception):
    """Raised by :meth:`Supervisor.prepare`: the attempt is over before launch (another node ended it);
    nothing is launched, and it counts as a failed attempt (``peer_failure``) for the restart policy."""


@dataclass
class RunResult:
    """What ``rlsup run`` ended with."""

    exit_code: int
    status: JobStatus
    attempts: int
    incidents: list[Incident]


class Supervisor:
    """Runs ``command`` under supervision with ``cfg``; call :meth:`run` once."""

    keeps_file_versions = True  #: single-file versions (several nodes would fight over one shared directory)

    def __init__(self, cfg: SupervisorConfig, command: Sequence[str], observer: Observer | None = None,
                 job: JobIdentity | None = None, processes: ProcessLayer | None = None) -> None:
        self.job = job or job_identity(cfg.job_name, cfg.checkpoint_dir, multi_node=False)
        self.cfg = cfg.resolved()
        self.command = list(command)
        self.state_dir = Path(self.cfg.state_dir)
        self.checkpoint_dir = Path(self.cfg.checkpoint_dir)
        self.observer = observer or Observer()
        self.processes = processes or ProcessLayer()
        self.policy = RestartPolicy.from_config(self.cfg)
        self.hang_settings = HangSettings.from_config(self.cfg)
        self.auto_timeout = AutoTimeout.from_settings(self.hang_settings)
        self.stop_signal: int | None = None
        self.preempted = False
        self._wake = threading.Event()
        self.incidents: list[Incident] = []
        self.state = JobState(JobStatus.INIT, 0, os.getpid(), self.command, time.time())
        from supervisor.warm_start import WarmStarts

        self.warm = WarmStarts(self.command, self.cfg.warm_launcher, self.cfg.warm_imports, self._log)  # next root
        self.node_name = node_name()  # what incidents, metrics and the SLURM exclude list call this machine
        from supervisor.tiers.persistent import PersistentTier

        self.persistent = PersistentTier.from_config(self.cfg, job=self.job.id)  # None when persistent_dir is empty
        from supervisor.tiers.memory_tier import MemoryTier

        self.memory = MemoryTier.from_config(self.cfg, self.checkpoint_dir, self.job.id)  # None: memory_dir empty
        from supervisor.checkpoint_sight import CheckpointSight

        self.sight = CheckpointSight(self.cfg, self.checkpoint_dir, self._log,  # single-file, unreadable, steps
                                     keep_file_versions=self.keeps_file_versions)

    # ------------------------------------------------------------ the loop

    def run(self) -> RunResult:
        previous = self._install_signal_handlers()
        try:
            return self._run()
        finally:
            self.warm.discard()  # every way out, exceptions included: no unused launcher outlives rlsup
            self.processes.release_attempts()  # nothing recorded outlives the run; the guardian goes
            for signum, handler in previous.items():  # a second Supervisor in this process starts clean
                signal.signal(signum, handler)

    def request_stop(self, signum: int, preempted: bool = False) -> None:
        """Stop the run (from any thread but a signal handler): the job is asked to save and exit; rlsup
        exits 128+signal, or REQUEUE when ``preempted``."""
        self._note_stop(signum, preempted)
        self._wake.set()

    def _note_stop(self, signum: int, preempted: bool = False) -> None:
        """The signal handlers': assignments, no lock (a handler runs inside the main thread's Event.wait or
        an earlier handler's Event.set, whose lock it would wait for forever); the loop polls them."""
        self.preempted = self.preempted or preempted
        self.stop_signal = signum

    def _run(self) -> RunResult:
        self.processes.become_subreaper()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if not self.sight.default_dir or self.persistent is not None or self.memory is not None:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)  # given (or a tier's): a stray default is not made
        if self.persistent is not None:
            self.persistent.start(self.checkpoint_dir)
        if self.memory is not None:
            self.memory.start()
        self.sight.start()
        attempt = self.first_attempt()
        pending: tuple[Incident, float] | None = None  # last failure, recorded once the next attempt starts
        while True:
            rlsup_log.set_context(attempt=attempt)  # rlsup's lines from here on: a<attempt>
            self._set_state(JobStatus.STARTING, attempt=attempt)
            sick = self.check_health(attempt)
            if sick is not None:
                return self._unhealthy(attempt, sick, pending)
            try:
                resume = self.prepare(attempt)
            except AttemptAbandoned as e:
                self._log(f"attempt {attempt}: not launched: {e}")
                if pending is not None:
                    self._record(pending[0])
                resume, result = None, AttemptResult(attempt, EndReason.PEER_FAILURE, None, detail=str(e))
            else:
                result = self._launch_and_watch(attempt, resume, pending)
            if result.reason == EndReason.SUCCESS:  # the real exit code (non-zero after a trainer's done line)
                self._set_state(JobStatus.SUCCEEDED, exit_code=result.exit_code or 0)
                return self._finish(exit_codes.OK, JobStatus.SUCCEEDED, attempt, result.detail)
            if result.reason in (EndReason.STOPPED, EndReason.PREEMPTED):
                self._record(self._incident(result, Action.STOP))
                return self._stopped(attempt)
            incident, delay = self.decide(attempt, result, resume)
            if delay is None:
                code, why = give_up_code(incident.action, result, self.policy.settings.max_no_progress_attempts)
                self._log(why)
                self._set_state(JobStatus.GAVE_UP, exit_code=code)
                return self._finish(code, JobStatus.GAVE_UP, attempt)
            pending = (incident, result.ended)
            self._set_state(JobStatus.BACKOFF)
            if self._backoff(delay):
                self._record(incident)
                return self._stopped(attempt)
            attempt = self.next_attempt(attempt)

    def _backoff(self, delay: float) -> bool:
        """Wait ``delay``; True as soon as a stop is asked (a signal's within a poll_interval: _note_stop)."""
        deadline = time.monotonic() + delay
        while self.stop_signal is None and (left := deadline - time.monotonic()) > 0:
            self._wake.wait(min(left, self.cfg.poll_interval))
        return self.stop_signal is not None

    def _launch_and_watch(self, attempt: int, resume: ResumePoint | None,
                          pending: tuple[Incident, float] | None) -> AttemptResult:
        self._update_state(attempt=attempt, resume=resume)
        job, hb_dir = self.launch(attempt, resume)
        if pending is not None:
            self._record(pending[0], downtime=time.monotonic() - pending[1], resume=resume)
        self._set_state(JobStatus.RUNNING, job_pid=job.pid)
        result = self.watch(job, hb_dir, attempt)
        self.cleanup(job, result)
        return result

    def decide(self, attempt: int, result: AttemptResult, resume: ResumePoint | None) -> tuple[Incident, float | None]:
        """A failed attempt: its incident, and the delay before the next one (None: give up, recorded now)."""
        self._set_state(JobStatus.FAILED)
        self.attempt_failed(attempt, result)
        newest = self.progress_marker()
        progress = self.sight.judge(result.last_step, newest, resume)  # supervisor.attempt_progress
        result.last_step = step_reached(result.last_step, resume.step if resume else None, newest)
        decision = self.policy.decide(result.exit_code, progress.progressed)
        self.observer.attempt_failed(result.reason, result.last_step)
        incident = self._incident(result, decision.action)
        if not decision.restart:
            self.give_up(f"node gave up after attempt {attempt}: {decision.action}")
            self._record(incident)
            return incident, None
        self._log(f"attempt {attempt} failed ({result.reason}{': ' + result.detail if result.detail else ''}); "
                  f"restarting in {decision.delay_s:.1f}s")
        return incident, decision.delay_s

    def _stopped(self, attempt: int) -> RunResult:
        """rlsup was asked to stop (exit 128+signal) or preempted (exit for requeue). A job that exited
        before rlsup acted on the signal still passes through STOPPING (the table has no shortcut)."""
        if self.state.state == JobStatus.RUNNING:
            self._set_state(JobStatus.STOPPING)
        status = JobStatus.PREEMPTED if self.preempted else JobStatus.STOPPED
        code = exit_codes.REQUEUE if self.preempted else exit_codes.from_signal(self.stop_signal or signal.SIGTERM)
        self._set_state(status, exit_code=code)
        return self._finish(code, status, attempt)

    # ------------------------------------------------------------ steps (overridable)

    def check_health(self, attempt: int) -> AttemptResult | None:
        """Run ``pre_launch_check`` (if set); the failed attempt it makes, or None when healthy."""
        from supervisor.health import check_node

        sick = check_node(self.cfg.pre_launch_check, self.cfg.pre_launch_timeout, attempt, self.node_name)
        if sick is not None:
            self._log(f"attempt {attempt}: {sick.verdict}")
        return sick

    def _unhealthy(self, attempt: int, result: AttemptResult, pending: "tuple[Incident, float] | None") -> RunResult:
        """Stop without launching: record the node for the requeue's ``--exclude`` and exit UNHEALTHY."""
        from supervisor.health import record_unhealthy

        if pending is not None:
            self._record(pending[0])
        self._record(self._incident(result, Action.EXCLUDE_NODE))
        path = record_unhealthy(self.state_dir, self.node_name)
        self._log(f"node {self.node_name} recorded in {path}; requeue the job without it")
        self.observer.suspect(self.node_name, "health")
        self._set_state(JobStatus.FAILED)
        self._set_state(JobStatus.GAVE_UP, exit_code=exit_codes.UNHEALTHY)
        return self._finish(exit_codes.UNHEALTHY, JobStatus.GAVE_UP, attempt)

    def first_attempt(self) -> int:
        """0, or the attempt after the one a previous rlsup was running when it died (SIGKILL, OOM).
        What a dead predecessor's attempt left running (its cgroup, or its recorded sessions and pids
        whose start times still match) is ended first; then this run's attempts are guarded."""
        from supervisor.incidents import read_state

        prev = read_state(self.state_dir)
        leftovers = self.processes.end_predecessor(self.state_dir)
        ended = "" if leftovers is None else "; nothing of its attempt was left running" if not leftovers[1] \
            else f"; ended what its attempt left: {', '.join(map(str, leftovers[1]))}"
        if leftovers and leftovers[1]:
            self._log(f"a previous rlsup (pid {leftovers[0]}) died{ended}")
        self.processes.guard_attempts(self.state_dir)
        if not prev or prev.get("state") in FINAL or self.processes.pid_exists(int(prev.get("pid", 0))):
            return 0
        attempt = int(prev.get("attempt", 0))
        self._record(Incident(time=time.time(), attempt=attempt, reason=EndReason.SUPERVISOR_LOST,
                              action=Action.RESTART,
                              last_step=prev.get("last_step"),
                              detail=f"rlsup pid {prev.get('pid')} died while the job was {prev.get('state')}{ended}"))
        self._log(f"a previous rlsup died during attempt {attempt}; continuing with attempt {attempt + 1}")
        return attempt + 1

    def next_attempt(self, attempt: int) -> int:
        return attempt + 1

    def prepare(self, attempt: int) -> ResumePoint | None:
        """Everything before launch; returns the checkpoint to resume from (fetched from the
        persistent tier when that holds a newer valid step than the local directory)."""
        if (self.persistent is not None or self.memory is not None) and self.cfg.resume:
            from supervisor.tiers.selection import choose_across_tiers

            point = choose_across_tiers(self.checkpoint_dir, self.persistent, self.cfg.checkpoint_layout,
                                        job=self.job.id, memory=self.memory)
            if self.memory is not None:
                self.memory.protect(point.path if point is not None else None)
            if point is not None:
                self.observer.checkpoint(point.step, point.path.stat().st_mtime)
        else:
            self.sight.before_choosing()
            point = self.choose_resume()
        if point is not None and self.cfg.repair_tracker:
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
        in_memory = self.memory.newest_valid(full=False) if self.memory is not None and self.cfg.resume else None
        if in_memory is not None and (point is None or in_memory[0] > point.step):
            return in_memory[0]
        return point.step if point is not None else None

    def choose_resume(self) -> ResumePoint | None:
        if not self.cfg.resume:
            return None
        point = choose_resume(self.checkpoint_dir, self.cfg.checkpoint_layout, self.job.id)
        if point is None:
            return self.sight.resume_fallback()  # a single-file checkpoint, which names no step
        self.observer.checkpoint(point.step, point.path.stat().st_mtime)
        return point

    def _refresh_checkpoint_metric(self) -> None:
        """A save just ended: report the newest checkpoint. Sizes only for rlsup's own layout, so the
        supervisor does not re-read every byte the trainer just wrote (restart selection checks all)."""
        from rlsup_format.manifest import latest_valid

        if self.cfg.checkpoint_layout in ("rlsup", "auto"):
            result = latest_valid(self.checkpoint_dir, full=False)
            if result is not None and result.step is not None:
                self.observer.checkpoint(result.step, result.path.stat().st_mtime)
                return
        self.choose_resume()

    def attempt_env(self, attempt: int, resume: ResumePoint | None, hb_dir: Path) -> dict[str, str]:
        env = dict(os.environ)
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
            "RLSUP_PREEMPT_SIGNAL": self._preempt_signum().name,
            ENV_JOB_ID: self.job.id,
        })
        env.setdefault(ERROR_FILE_ENV, str(error_file_for(hb_dir)))  # torchrun's failure report, unless the user's
        if self.cfg.progress or self.cfg.progress_regex:  # progress is read from the output: as it is printed
            env.setdefault("PYTHONUNBUFFERED", "1")
        if self.cfg.resume:
            # The step every rank must load, or empty for "start fresh": trainer_hooks never picks another
            # step on its own under rlsup (a rank quietly starting over loses the run). Not set with
            # resume: false, where the trainer chooses.
            env["RLSUP_RESUME_DIR"] = str(resume.path) if resume is not None else ""
        if resume is not None and resume.step is not None:
            env["RLSUP_RESUME_STEP"] = str(resume.step)
        return env

    def launch(self, attempt: int, resume: ResumePoint | None) -> tuple[JobProcess, Path]:
        attempt_dir = self.state_dir / "attempts" / f"attempt_{attempt:04d}"
        if attempt_dir.exists():
            shutil.rmtree(attempt_dir, ignore_errors=True)
        hb_dir = attempt_dir / "heartbeats"
        hb_dir.mkdir(parents=True)
        self._prune_attempt_dirs()
        where = "" if resume is None else f" from {resume.path}" if resume.step is None else \
            f" from step {resume.step} ({resume.path})"
        argv = self.attempt_command(resume)
        self._log(f"attempt {attempt}: launching {' '.join(argv)}{where}")
        env = self.attempt_env(attempt, resume, hb_dir)
        job = self.warm.start(attempt, env, argv, attempt_dir / "output.log", self.cfg.output_tail_lines)
        if job is None:
            job = self.processes.start(argv, env, attempt_dir / "output.log", self.cfg.output_tail_lines)
        attach_progress(self.cfg.progress, self.cfg.progress_regex, job, hb_dir)
        self.observer.attempt_started(attempt, resume.step if resume else None, known=self.sight.resume_known(resume))
        self.sight.attempt_launched()
        if resume is not None:
            self.observer.resumed_from(getattr(resume, "tier", "local"))
        self.warm.arm(env, self.policy.budget_left())
        return job, hb_dir

    def attempt_command(self, resume: ResumePoint | None) -> list[str]:
        """The launch command with its resume placeholders filled (:mod:`supervisor.launch_args`)."""
        from supervisor.launch_args import ResumeFill, expand

        return expand(self.command, None if resume is None else ResumeFill(str(resume.path), resume.step))

    def watch(self, job: JobProcess, hb_dir: Path, attempt: int) -> AttemptResult:
        """Poll until the job exits, a rank dies, it hangs, or rlsup is asked to stop."""
        deaths = RankDeathWatch()
        try:
            return self._watch(job, hb_dir, attempt, deaths)
        finally:
            deaths.close()

    def _watch(self, job: JobProcess, hb_dir: Path, attempt: int, deaths: RankDeathWatch) -> AttemptResult:
        detector = HangDetector.from_settings(hb_dir, self.hang_settings, self.auto_timeout, self.processes.alive)
        stragglers = self._straggler_watch(attempt)
        oom_before = self.processes.oom_kill_count()
        first_dead: tuple[int, int] | None = None
        saves_seen = 0
        while True:
            code = job.poll()
            if code is not None:
                if code != 0 and self.stop_signal is None and job.output.finished is None:
                    # A failed root: its children must not train on while the output drains (a failed
                    # attempt is SIGKILLed anyway); a success or a stop keeps cleanup's SIGTERM and grace.
                    killed = job.terminate_tree(0.0)
                    if killed:
                        self._log(f"attempt {attempt}: job root exited with {code}; killed what it left: {killed}")
                job.output.join(timeout=2)
                return self._classify_exit(attempt, code, job, detector, first_dead, oom_before)
            if self.stop_signal is not None:
                return self._stop_job(attempt, job, detector)
            peer = self.peer_ended(attempt)
            if peer is not None:
                self._log(f"attempt {attempt}: ended by another node ({peer}); stopping this node's job")
                return AttemptResult(attempt, EndReason.PEER_FAILURE, None, detail=peer, last_step=detector.last_step(),
                                     output_tail=job.output.tail())
            job.refresh()
            verdict = detector.check()
            self.observer.heartbeats(detector.records, detector.timeout())
            self.state.heartbeat_timeout_s = detector.timeout()
            if self.state.last_step != (step := detector.last_step()):  # rlsup status follows the steps
                self.state.last_step = step
                self.sight.step_seen(step)
                publish_state(self.state_dir, self.state)
            if verdict is not None:
                return self._hang(attempt, job, detector, verdict)
            slow = stragglers.poll(detector.records)
            if slow is not None:  # straggler_action: restart
                return slow.attempt_result(detector.last_step(), job.output.tail())
            if first_dead is None:
                first_dead = self._first_dead_rank(detector)
            saves = sum(rec.saves for rec in detector.records.values())
            if saves != saves_seen:
                saves_seen = saves
                self._refresh_checkpoint_metric()  # a save just ended
            deaths.track((rec.rank, rec.pid) for rec in detector.records.values() if rec.pid != job.pid)
            death = None if self.stop_signal is not None else deaths.wait(self.cfg.poll_interval)
            if death is not None and job.poll() is None:
                self._log(f"attempt {attempt}: {death.describe()}; ending the attempt")
                detector.scan()  # the steps the ranks reached since the last poll (the incident's last_step)
                return from_rank_death(attempt, death, tail=job.output.tail(), last_step=detector.last_step(),
                                       oom_rose=self._oom_rose(oom_before))

    def cleanup(self, job: JobProcess, result: AttemptResult) -> None:
        """Nothing of an attempt may survive it.

        A failed attempt (crash, hang, another node's failure) is killed at once with SIGKILL: a
        half-written step is harmless by design (manifest last), its stacks are already saved, and a
        rank stuck in a collective would only turn SIGTERM into should_stop() and never act on it. What
        is left of a successful, stopped or preempted job gets SIGTERM and ``kill_grace``."""
        graceful = result.reason in (EndReason.SUCCESS, EndReason.STOPPED, EndReason.PREEMPTED)
        killed = job.terminate_tree(self.cfg.kill_grace if graceful else 0.0)
        if killed:
            self._log(f"attempt {result.attempt}: killed leftover processes {killed}")

    # ------------------------------------------------------------ classification

    def _classify_exit(self, attempt: int, code: int, job: JobProcess, detector: HangDetector,
                       first_dead: tuple[int, int] | None, oom_before: int | None) -> AttemptResult:
        detector.scan()  # the last beats (the output's, where it speaks: job.output was joined)
        return classify_exit(attempt, code, tail=job.output.tail(), last_step=detector.last_step(), job_pid=job.pid,
                             first_dead=first_dead, oom_rose=self._oom_rose(oom_before), finished=job.output.finished,
                             stop_reason=self._stop_reason() if self.stop_signal is not None else None,
                             error_file=error_file_for(detector.directory))

    def _oom_rose(self, oom_before: int | None) -> bool:
        return oom_before is not None and (self.processes.oom_kill_count() or 0) > oom_before

    def _first_dead_rank(self, detector: HangDetector) -> tuple[int, int] | None:
        for rec in detector.records.values():
            if rec.pid and not self.processes.pid_exists(rec.pid):
                return rec.rank, rec.pid
        return None

    def _straggler_watch(self, attempt: int) -> StragglerWatch:
        return StragglerWatch(StragglerDetector(self.cfg.straggler_factor, self.cfg.straggler_window, self.node_name,
                                                attempt), self.state_dir, self.cfg.straggler_action == "restart",
                              self._log, self.observer)

    def _hang(self, attempt: int, job: JobProcess, detector: HangDetector, verdict: HangVerdict) -> AttemptResult:
        reason = EndReason.HANG if verdict.reason == "heartbeat_timeout" else EndReason(verdict.reason)
        who = f"rank {verdict.rank} (pid {verdict.pid})" if verdict.rank is not None else "no rank"
        detail = f"{who} silent for {verdict.silent_s:.2f}s > {verdict.reason} {verdict.timeout_s:.2f}s"
        self._log(f"attempt {attempt}: hang detected: {detail}; dumping stacks")
        stacks = self.processes.dump_stacks(detector.directory, detector.records)
        return self._with_verdict(attempt, AttemptResult(
            attempt, reason, None, rank=verdict.rank, pid=verdict.pid, detail=detail, stacks=stacks,
            last_step=detector.last_step(), output_tail=job.output.tail()))

    def _with_verdict(self, attempt: int, result: AttemptResult) -> AttemptResult:
        """Group the stacks taken and lead the log with who to blame (the ranks outside the majority)."""
        from supervisor.stack_groups import add_verdict

        add_verdict(result, self.node_name)
        if result.verdict:
            self._log(f"attempt {attempt}: {result.verdict}")
        for node in result.suspect_nodes:
            self.observer.suspect(node, "stacks")
        return result

    def _stop_job(self, attempt: int, job: JobProcess, detector: HangDetector) -> AttemptResult:
        """Ask the job to save and exit (stop flags + signal), wait stop_grace, then end it."""
        assert self.stop_signal is not None
        self._set_state(JobStatus.STOPPING)
        detector.scan()
        for rank in detector.records:
            try:
                request_stop(detector.directory / rank_file_name(rank))
            except OSError:
                pass
        if self.preempted:
            # Only ranks that registered (trainer_hooks installed the handler) get the preemption signal;
            # the job's root only where no rank did (its record is the output's: ``progress``).
            for rec in registered_ranks(detector.records).values():
                self.processes.kill(rec.pid, self.stop_signal)
        else:
            job.send(self.stop_signal)
        self._log(f"stopping: waiting up to {self.cfg.stop_grace:.0f}s for the job to save and exit")
        code = job.wait_exit(self.cfg.stop_grace)
        stacks: dict[str, str] = {}
        if code is None:  # where the ranks are stuck is what the operator needs to know next
            self._log(f"the job did not exit within stop_grace {self.cfg.stop_grace:.0f}s; dumping stacks, then "
                      "killing it")
            detector.scan()
            stacks = self.processes.dump_stacks(detector.directory, detector.records)
        result = AttemptResult(attempt, self._stop_reason(), code, last_step=detector.last_step(),
                               output_tail=job.output.tail(), stacks=stacks,
                               detail=f"job exited with {code}" if code is not None else "killed after stop_grace")
        return self._with_verdict(attempt, result) if stacks else result

    # ------------------------------------------------------------ helpers

    def _preempt_signum(self) -> signal.Signals:
        name = self.cfg.preempt_signal
        return getattr(signal, name if name.startswith("SIG") else "SIG" + name)

    def _stop_reason(self) -> EndReason:
        return EndReason.PREEMPTED if self.preempted else EndReason.STOPPED

    def _install_signal_handlers(self) -> dict[int, Any]:
        """SIGTERM/SIGINT stop, the preemption signal preempts; the handlers they replace (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        handlers = {signal.SIGTERM: lambda signum, _f: self._note_stop(signum),
                    signal.SIGINT: lambda signum, _f: self._note_stop(signum),
                    self._preempt_signum(): lambda signum, _f: self._note_stop(signum, preempted=True)}
        return {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}

    def _incident(self, result: AttemptResult, action: Action) -> Incident:
        return Incident(time=time.time(), attempt=result.attempt, reason=result.reason, exit_code=result.exit_code,
                        signal=result.signal, rank=result.rank, pid=result.pid, detail=result.detail,
                        output_tail=result.output_tail, stacks=result.stacks, last_step=result.last_step,
                        action=action, verdict=result.verdict, suspect_ranks=result.suspect_ranks,
                        suspect_nodes=result.suspect_nodes)

    def _record(self, incident: Incident, downtime: float | None = None, resume: ResumePoint | None = None) -> None:
        incident.downtime_s = None if downtime is None else round(downtime, 3)
        if resume is not None:
            incident.resumed_from, incident.resumed_step = str(resume.path), resume.step
            incident.resumed_tier = getattr(resume, "tier", "local")
        if downtime is not None:
            incident.resume_known = self.sight.resume_known(resume)
        append_incident(self.state_dir, incident)
        self.incidents.append(incident)
        if downtime is not None:
            self.observer.downtime(downtime)

    def _set_state(self, status: JobStatus, *, attempt: int | None = None, resume: ResumePoint | None = None,
                   job_pid: int | None = None, exit_code: int | None = None) -> None:
        """Move to ``status`` (IllegalTransition if the lifecycle table does not allow it), with its details."""
        self.state.state = check_transition(self.state.state, status)
        self._update_state(attempt=attempt, resume=resume, job_pid=job_pid, exit_code=exit_code, changed=True)

    def _update_state(self, *, attempt: int | None = None, resume: ResumePoint | None = None,
                      job_pid: int | None = None, exit_code: int | None = None, changed: bool = False) -> None:
        """Details of the current state (state.json); the observer hears of state changes only."""
        if attempt is not None:
            self.state.attempt = attempt
            self.state.resume_step = resume.step if resume else None
            self.state.resume_dir = str(resume.path) if resume else None
            self.state.resume_tier = getattr(resume, "tier", "local") if resume else None
        if job_pid is not None:
            self.state.job_pid = job_pid
        if exit_code is not None:
            self.state.exit_code = exit_code
        write_state(self.state_dir, self.state)
        if changed:
            self.observer.state(self.state.state.value)

    def _finish(self, code: int, status: JobStatus, attempt: int, why: str = "") -> RunResult:
        self.warm.discard()  # no next attempt: do not keep a launcher alive through the final copy
        if self.memory is not None:  # the newest memory step to disk first (the persistent flush reads disk)
            self.memory.finish(remove=status == JobStatus.SUCCEEDED, timeout=self.cfg.stop_grace)
        if self.persistent is not None:  # the last checkpoint, whatever the cadence; the tier logs the copy
            self.persistent.flush(self.cfg.stop_grace)
        self.sight.stop()
        self._log(f"{status.value} after {attempt + 1} attempt(s); exit {code}" + (f" ({why})" if why else ""))
        return RunResult(code, status, attempt + 1, self.incidents)

    def _prune_attempt_dirs(self) -> None:
        for old in sorted((self.state_dir / "attempts").glob("attempt_*"))[:-KEEP_ATTEMPT_DIRS]:
            shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def _log(message: str) -> None:
        """The run loop's own lines, on rlsup's one logging channel (:mod:`supervisor.log`)."""
        log.info(message)
