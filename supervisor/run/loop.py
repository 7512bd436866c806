"""The supervision loop of ``rlsup run``: launch, watch, classify, clean up, back off, relaunch.

The loop is short on purpose, and it is the same loop on one node and on several: what involves the job's
other nodes (the attempt and resume point they agree on, a failure or give-up told to them, another node's end
of the attempt) is asked of one collaborator passed in, :class:`supervisor.run.peers.Peers` (a single node's
:class:`~supervisor.run.peers.SingleNode` by default; :class:`supervisor.cluster.multinode.NodeGroup` on several).
Nothing of the loop is overridden. Its parts live with their own code: the settings it reads
(:mod:`supervisor.run.settings`), state.json and the incidents (:mod:`supervisor.run.record`), the watch
of a running attempt (:mod:`supervisor.run.attempt_watch`), stop and preemption signals
(:mod:`supervisor.stop_request`) and the warm launcher (:mod:`supervisor.launch.warm_start`). Everything it
does to processes goes through a :class:`~supervisor.processes.layer.Processes` (the real
:class:`~supervisor.processes.job.OsProcesses` by default, a fake one in the in-process tests,
tests/run/test_run_loop.py), and the loop reads no config: each part keeps its own settings, built once.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from rlsup_format import job_env, state_files
from rlsup_format.manifest import KnownDigests, latest_valid
from supervisor import exit_codes, log as rlsup_log
from supervisor.diagnosis.evidence import AttemptEvidence, EndedElsewhere, GpuEvidence
from supervisor.diagnosis.outcome import ERROR_FILE_ENV, AttemptResult, classify, error_file_for, job_settled
from supervisor.run.progress_rule import step_reached
from supervisor.bounded_calls import BoundedCalls
from supervisor.run.attempt_watch import AttemptWatch
from supervisor.run.checkpoint_sight import CheckpointSight, SightSettings
from supervisor.config import SupervisorConfig
from supervisor.diagnosis.gpu_failures import KMSG, probe_node
from supervisor.diagnosis.hang_detector import AutoTimeout, HangSettings
from supervisor.membership import node_name
from supervisor.run.incidents import Incident, JobState
from supervisor.run.node_health import mark_repeat_offender
from supervisor.run.peers import Peers, SingleNode
from supervisor.job_identity import JobIdentity, job_identity
from supervisor.lifecycle import EXCLUDES_NODE, Action, EndReason, JobStatus, route
from supervisor.observer import Observer
from supervisor.processes.job import OsProcesses
from supervisor.processes.layer import Job, Processes
from supervisor.diagnosis.step_reports import attach as attach_progress
from supervisor.run.restart_policy import RestartPolicy, give_up_code
from supervisor.run.record import RunRecord, RunResult, incident_for
from supervisor.run.settings import RunSettings
from supervisor.stop_request import StopRequest
from supervisor.tiers.memory_tier import MemoryTier
from supervisor.tiers.persistent import PersistentTier
from supervisor.tiers.resume import ResumePoint, choose_resume, newest_step, repair_tracker
from supervisor.launch.warm_start import WarmStarts

if TYPE_CHECKING:
    from supervisor.diagnosis.unkillable import StuckProcess

log = logging.getLogger(__name__)

ResumeChoice = Callable[[], "ResumePoint | None"]  # a node's resume point from its own checkpoint directory


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


@dataclass(frozen=True)
class NodeTiers:
    """This node's checkpoint tiers (None: not configured), built once for the node (its rank among ``nodes``):
    the loop and the job's other nodes (:class:`~supervisor.run.peers.Peers`) share them. ``known``: the checksums
    one restart computed, from the progress marker (:meth:`Supervisor.decide`) to the resume point agreed
    (:meth:`Supervisor.prepare`, which forgets them): each byte of the chosen step is hashed once per restart."""

    persistent: PersistentTier | None
    memory: MemoryTier | None
    known: KnownDigests = field(default_factory=KnownDigests, compare=False)

    @classmethod
    def from_config(cls, cfg: SupervisorConfig, job: str, node_rank: int = 0, nodes: int = 1) -> "NodeTiers":
        """``cfg``: resolved (:meth:`SupervisorConfig.resolved`); ``job``: the job's identity."""
        return cls(PersistentTier.from_config(cfg, node_rank, job),
                   MemoryTier.from_config(cfg, RunSettings.from_config(cfg).checkpoint_dir, job, node_rank, nodes))


# how an attempt ended without this node's job failing that is nobody's failure: nothing to tell the others, no
# Flight Recorder verdict to gather
NOT_FAILED_ELSEWHERE = frozenset({EndReason.STOPPED, EndReason.PREEMPTED, EndReason.RESIZED})


class AttemptAbandoned(Exception):
    """Raised by :meth:`Supervisor.prepare`: the attempt is over before launch (another node ended it);
    nothing is launched, and it counts as a failed attempt (``peer_failure``) for the restart policy, unless node 0
    ended it to grow the job back (``reason``: ``resized``, not counted)."""

    def __init__(self, why: str, reason: EndReason = EndReason.PEER_FAILURE) -> None:
        super().__init__(why)
        self.reason = reason


class Supervisor:
    """Runs ``command`` under supervision with ``cfg``; call :meth:`run` once.

    ``peers``: the job's other nodes (default: none, :class:`SingleNode`). ``tiers``: this node's checkpoint
    tiers, when the caller shares them with ``peers`` (default: built here for a single node). ``stop``: a stop
    request whose signal handlers the caller installed (the command line's, from before a node's start-up: one
    installation for the whole run); default: the loop's own, installed by :meth:`run`. ``warm``: a launcher
    armed before this run (a spare's, while it waited), used instead of a fresh one. ``processes``: what it does to
    processes (default: the real ones, :class:`OsProcesses`). ``resume_choice``: the resume point in the node's own
    checkpoint directory, where no tier is configured, and the progress marker's (default: :meth:`choose_resume`;
    the in-process tests pass the steps their fake jobs saved).

    ``cfg`` is read here only, to build each part's settings; none of them, nor the loop, keeps it."""

    def __init__(self, cfg: SupervisorConfig, command: Sequence[str], observer: Observer | None = None,
                 job: JobIdentity | None = None, processes: Processes | None = None, *,
                 peers: Peers | None = None, tiers: NodeTiers | None = None, stop: StopRequest | None = None,
                 warm: WarmStarts | None = None, resume_choice: ResumeChoice | None = None) -> None:
        self.job = job or job_identity(cfg.job_name, cfg.checkpoint_dir, multi_node=False)
        cfg = cfg.resolved()  # absolute paths, so attempts launched in other directories agree
        self.settings = RunSettings.from_config(cfg)
        self.command = list(command)
        self.state_dir, self.checkpoint_dir = self.settings.state_dir, self.settings.checkpoint_dir
        self.observer = observer or Observer()
        self.processes: Processes = processes or OsProcesses()
        self.resume_choice: ResumeChoice = resume_choice or self.choose_resume
        self.peers: Peers = peers or SingleNode()
        self.policy = RestartPolicy.from_config(cfg)
        hang = HangSettings.from_config(cfg)
        self.installs_stop = stop is None  # the handlers of a stop passed in are the caller's
        self.stop = stop or StopRequest(self.settings.preempt_signal)
        if warm is not None:
            warm.adopt(self.command, self._log)  # the loop's from here on (discarded at the end)
        self.warm = warm or WarmStarts(self.command, self.settings.warm_launcher, self.settings.warm_imports,
                                       self._log, self.settings.warm_cuda,
                                       self.settings.warm_fork)  # the next attempt's root, spawned early
        self.node_name = node_name()  # what incidents, metrics and the SLURM exclude list call this machine
        tiers = tiers or NodeTiers.from_config(cfg, self.job.id)
        self.persistent, self.memory = tiers.persistent, tiers.memory  # None: persistent_dir / memory_dir empty
        self.known = tiers.known  # checksums of one restart (NodeTiers), shared with the peers
        if self.persistent is not None:
            self.observer.tier("persistent", self.persistent.stalled)
        self.sight = CheckpointSight(SightSettings.from_config(cfg), self._log,  # single-file, unreadable, steps
                                     keep_file_versions=self.peers.size == 1)  # nodes would fight over one directory
        self.record = RunRecord(self.state_dir, self.command, self.observer, self.sight.resume_known)
        learned = AutoTimeout.from_settings(hang, self.state_dir / state_files.LEARNED_TIMEOUT, self.command)  # across runs
        self.watcher = AttemptWatch(self.settings, hang, learned, self.processes, self.stop,
                                    self.record, self.sight, self.observer, self.node_name, self.peers.peer_ended,
                                    self.refresh_checkpoint_metric, fr_share=self.peers.flight_records)
        self.checkpoint_reads = BoundedCalls(f"reading the checkpoint directory {self.checkpoint_dir}", 10.0,
                                             forked=True)  # a read stuck in a hung mount never holds rlsup's exit
        self.kernel_log: str | os.PathLike | None = KMSG  # the GPU's word on any ending (GpuEvidence); tests: a file
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
        previous = self.stop.install() if self.installs_stop else {}
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
                why = self.stop.reason if self.stop.asked else e.reason  # stopped in a wait: a stop
                resume, result = None, self._classify(AttemptEvidence(attempt, EndedElsewhere(why, str(e)), self.node_name))
            else:
                if (world := self.peers.world()) is not None:
                    self.record.world_nodes(world.nodes, world.job_nodes)  # state.json and the metric
                    if pending is not None and world.change:
                        pending[0].world = world.change  # the failure's incident says what the job went on with
                result = self._launch_and_watch(attempt, resume, pending)
            if result.reason == EndReason.SUCCESS:  # the real exit code (non-zero after a trainer's done line)
                reached = step_reached(result.last_step, resume.step if resume else None, None)  # not below the resume
                self.record.set_state(JobStatus.SUCCEEDED, exit_code=result.exit_code or 0, last_step=reached)
                return self._finish(exit_codes.OK, JobStatus.SUCCEEDED, attempt, result.detail)
            if result.reason in (EndReason.STOPPED, EndReason.PREEMPTED):
                self.record_incident(incident_for(result, Action.STOP))
                return self._stopped(attempt)
            if result.reason in EXCLUDES_NODE:  # GPU broke, or a process in D: no restart here (gpu_failures, unkillable)
                return self._node_lost(attempt, result)
            if result.reason == EndReason.RESIZED:  # node 0 ended it to grow the job back: no failure, no policy
                self._log(f"attempt {attempt} ended to grow the job back; the next attempt starts now")
                incident, delay = incident_for(result, Action.RESTART), 0.0
                self.record.set_state(JobStatus.RESIZING)
            else:
                incident, delay = self.decide(attempt, result, resume)
                if delay is None:
                    code, why = give_up_code(incident.action, incident, self.policy.settings.max_no_progress_attempts)
                    self._log(why)
                    self.record.set_state(JobStatus.GAVE_UP, exit_code=code, last_step=incident.last_step)
                    return self._finish(code, JobStatus.GAVE_UP, attempt)
                self.record.set_state(JobStatus.BACKOFF)
            pending = (incident, result.ended)
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
        evidence = self.watch(job, hb_dir, attempt)
        stuck = self.cleanup(job, evidence, hb_dir)
        return self._classify(replace(evidence, gpu=GpuEvidence(started, self.kernel_log, self.gpu_probe),
                                      stuck=tuple(stuck), kill_grace=self.settings.kill_grace))

    def _classify(self, evidence: AttemptEvidence) -> AttemptResult:
        """The attempt's one outcome (:func:`supervisor.diagnosis.outcome.classify`), from its evidence and, for a
        failure, the Flight Recorder's verdict across nodes (gathered first: nothing rewrites the outcome).
        A failure is told to the other nodes first (:meth:`attempt_failed`): gathering the verdict may wait a
        minute, and they must not wait with it. A stop asked while waiting for the round asks nothing of them."""
        ending = evidence.ending
        if job_settled(ending) or (isinstance(ending, EndedElsewhere) and ending.reason in NOT_FAILED_ELSEWHERE):
            result = classify(evidence)
            if result.reason == EndReason.SUCCESS and (grown := self.peers.attempt_succeeded(evidence.attempt)):
                return classify(replace(evidence, ending=grown))  # node 0's grow back at the same save came first
            return result
        if not isinstance(ending, EndedElsewhere):  # the job failed here: of node 0's end to grow the job back?
            elsewhere = self.peers.peer_ended(evidence.attempt, grow=False)  # (its ranks went first, before the watch
            # looked); never the grow node 0 would start now: its own failure is a failure
            if elsewhere is not None and elsewhere.reason == EndReason.RESIZED:
                return classify(replace(evidence, ending=elsewhere))
        self.attempt_failed(evidence.attempt, classify(evidence))  # the verdict changes no reason or detail
        attempt_dir = state_files.attempt_path(self.state_dir, evidence.attempt)
        evidence = self.watcher.with_shared_flight(evidence, attempt_dir if attempt_dir.is_dir() else None)
        return classify(evidence)

    def decide(self, attempt: int, result: AttemptResult, resume: ResumePoint | None) -> tuple[Incident, float | None]:
        """A failed attempt: its incident, and the delay before the next one (None: give up, recorded now)."""
        self.record.set_state(JobStatus.FAILED)  # the other nodes were told when it was classified (_classify)
        newest = self.progress_marker()
        reached = step_reached(result.last_step, resume.step if resume else None, newest)
        progress = self.sight.judge(reached, newest, resume)  # supervisor.run.progress_rule
        decision = self.policy.decide(result.exit_code, progress.progressed)
        self.observer.attempt_failed(result.reason, reached)
        incident = incident_for(result, decision.action, self.sight.left_torn, reached)
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
        """The attempt failed with this node's hardware broken (:data:`EXCLUDES_NODE`): the other nodes were told;
        stop as a node failing pre_launch_check does (exit UNHEALTHY, the node in unhealthy_nodes)."""
        self.observer.attempt_failed(result.reason, result.last_step)  # the others were told in _classify
        self.give_up(f"node gave up after attempt {attempt}: {Action.EXCLUDE_NODE} ({result.reason})")
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

    def give_up_outside_attempt(self, code: int, why: str) -> RunResult:
        """The run ends between attempts for a reason of the caller's (the nodes could not agree): state.json says
        it gave up with ``code``, and the tiers take their final copy, as for any give-up; a later start then does
        not take this run for one that died mid-attempt."""
        try:
            for status in route(self.state.state, JobStatus.GAVE_UP):
                self.record.set_state(status, exit_code=code if status is JobStatus.GAVE_UP else None)
            return self._finish(code, JobStatus.GAVE_UP, self.state.attempt or 0, why)
        except Exception as err:  # noqa: BLE001 - recording is best effort: the caller's error must reach the command line
            self._log(f"could not record the give-up: {err}")
            return RunResult(code, JobStatus.GAVE_UP, self.state.attempt or 0, list(self.incidents))

    def _finish(self, code: int, status: JobStatus, attempt: int, why: str = "") -> RunResult:
        self.warm.discard()  # no next attempt: do not keep a launcher alive through the final copy
        if self.memory is not None:  # the newest memory step to disk first (the persistent flush reads disk)
            self.memory.finish(remove=status == JobStatus.SUCCEEDED, timeout=self.settings.stop_grace)
        if self.persistent is not None:  # the last checkpoint, whatever the cadence; the tier logs the copy
            self.persistent.flush(self.settings.stop_grace)
        self.sight.stop()
        return self.record.result(code, status, attempt, why)

    # ------------------------------------------------------------ steps

    def check_health(self, attempt: int) -> AttemptResult | None:
        """Run ``pre_launch_check`` (if set); the failed attempt it makes, or None when healthy (or when stopping:
        no check to wait for)."""
        from supervisor.run.node_health import check_node

        if self.stop.asked:
            return None
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
            return self.peers.join(0)
        lost = self.record.lost(prev, ended)
        self.record_incident(lost)
        self._log(f"a previous rlsup died during attempt {lost.attempt}; continuing with attempt {lost.attempt + 1}")
        return self.peers.join(lost.attempt + 1)

    def next_attempt(self, attempt: int) -> int:
        """The attempt after ``attempt``: the next one here, the one the nodes agree on (:meth:`Peers.join`)."""
        return self.peers.join(attempt + 1)

    def record_incident(self, incident: Incident, downtime: float | None = None,
                        resume: ResumePoint | None = None) -> None:
        """Record an ended attempt (:meth:`supervisor.run.record.RunRecord.add`); with ``downtime``, once the
        next attempt has started from ``resume``. A node that fails again is named (in a job of several nodes:
        :func:`~supervisor.run.node_health.mark_repeat_offender`)."""
        if incident not in self.incidents and mark_repeat_offender(incident, self.incidents, self.node_name,
                                                                   nodes=self.peers.size):
            self.observer.suspect(self.node_name, "repeated")
        self.record.add(incident, downtime, resume)

    def prepare(self, attempt: int) -> ResumePoint | None:
        """Everything before launch; returns the checkpoint every node resumes from (:meth:`Peers.agree`). The
        checksums computed since the failure (:meth:`progress_marker`) are reused for files unchanged since, then
        forgotten: the next restart hashes afresh."""
        try:
            return self.peers.agree(attempt, self._choose_here)
        finally:
            self.known.forget()

    def _choose_here(self) -> ResumePoint | None:
        """This node's own resume point (fetched from the persistent tier when that holds a newer valid step
        than the local directory)."""
        if (self.persistent is not None or self.memory is not None) and self.settings.resume:
            from supervisor.tiers.selection import choose_across_tiers

            point = choose_across_tiers(self.checkpoint_dir, self.persistent, self.settings.checkpoint_layout,
                                        job=self.job.id, memory=self.memory, known=self.known)
            if self.memory is not None:
                self.memory.protect(point.path if point is not None else None)
            if point is not None:
                self.observer.checkpoint(point.step, point.path.stat().st_mtime)
        else:
            self.sight.before_choosing(self.known)
            point = self.resume_choice()
        if point is not None and self.settings.repair_tracker:
            point = repair_tracker(self.checkpoint_dir, point, self._log)
        return point

    def attempt_failed(self, attempt: int, result: "AttemptResult") -> None:
        """This node's attempt failed: the other nodes are told (:meth:`Peers.attempt_failed`)."""
        self.peers.attempt_failed(attempt, result)

    def give_up(self, reason: str) -> None:
        """This node stops restarting: the other nodes are told (:meth:`Peers.give_up`)."""
        self.peers.give_up(reason)

    def progress_marker(self) -> int | None:
        """Newest valid checkpoint step, to tell whether a failed attempt made progress (:meth:`Peers.progress_marker`)."""
        return self.peers.progress_marker(self._newest_here)

    def _newest_here(self) -> int | None:
        """One node's marker (:func:`supervisor.tiers.resume.newest_step`): the resume point's step, or the memory
        tier's newer one; its checksums are kept for :meth:`prepare`."""
        point = self.resume_choice()
        return newest_step(point.step if point is not None else None, self.memory if self.settings.resume else None)

    def choose_resume(self) -> ResumePoint | None:
        """The newest valid step a layout reads in the checkpoint directory (its metric set), else the newest
        complete single-file checkpoint; None with ``resume`` off or nothing to resume from."""
        point, chosen = self._resume_point()
        if chosen is not None:  # a layout's step (the single-file fallback sets no metric)
            self.observer.checkpoint(chosen.step, chosen.path.stat().st_mtime)
        return point

    def _resume_point(self) -> tuple[ResumePoint | None, ResumePoint | None]:
        """:meth:`choose_resume` without the metric, safe in a forked child (no lock of the observer's): the point,
        and the same when a layout chose it (None for the single-file fallback, which names no step)."""
        if not self.settings.resume:
            return None, None
        point = choose_resume(self.checkpoint_dir, self.settings.checkpoint_layout, self.job.id, self.known)
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

        for key in (job_env.RESUME_DIR, job_env.RESUME_STEP, *MEMORY_ENV):
            env.pop(key, None)
        if self.memory is not None:
            env.update(self.memory.env())  # the job's memory tier: ranks save there (trainer_hooks.memory_tier)
        env.update({
            job_env.RESTART_COUNT: str(attempt),
            job_env.CHECKPOINT_DIR: str(self.checkpoint_dir),
            job_env.HEARTBEAT_DIR: str(hb_dir),
            job_env.STATE_DIR: str(self.state_dir),
            job_env.PREEMPT_SIGNAL: self.settings.preempt_signal.name,
            job_env.JOB_ID: self.job.id,
        })
        env.setdefault(ERROR_FILE_ENV, str(error_file_for(hb_dir)))  # torchrun's failure report, unless the user's
        if self.settings.resume:
            # The step every rank must load, or empty for "start fresh": trainer_hooks never picks another
            # step on its own under rlsup (a rank quietly starting over loses the run). Not set with
            # resume: false, where the trainer chooses.
            env[job_env.RESUME_DIR] = str(resume.path) if resume is not None else ""
        if resume is not None and resume.step is not None:
            env[job_env.RESUME_STEP] = str(resume.step)
        env.update(self.peers.env())  # the job's nodes: this node's rank among them
        return env

    def launch(self, attempt: int, resume: ResumePoint | None) -> tuple[Job, Path]:
        attempt_dir = self.record.fresh_attempt_dir(attempt)
        hb_dir = attempt_dir / state_files.HEARTBEATS
        where = "" if resume is None else f" from {resume.path}" if resume.step is None else \
            f" from step {resume.step} ({resume.path})"
        argv = self.peers.command(self.attempt_command(resume))
        # Where the trainer picks its own checkpoint: said, with a torn newest one it would load (bounded: a hung mount)
        note = self.checkpoint_reads.call(lambda: self.sight.launch_note(self.command, resume), "")
        self._log(f"attempt {attempt}: launching {' '.join(argv)}{where}{note}")
        if self.memory is not None and self.settings.resume and (resume is None or resume.step is not None):
            self.memory.supersede(resume.step if resume is not None else None)  # steps of an abandoned timeline
        env = self.attempt_env(attempt, resume, hb_dir)
        tail_lines = self.settings.output_tail_lines
        if self.settings.warm_first_attempt:
            self.warm.arm_now(argv, env)  # none waiting (the first attempt): one for this attempt, as later ones have
        job: Job | None = self.warm.start(attempt, env, argv, attempt_dir / state_files.OUTPUT_LOG, tail_lines)
        if job is None:
            job = self.processes.start(argv, env, attempt_dir / state_files.OUTPUT_LOG, tail_lines)
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

    def watch(self, job: Job, hb_dir: Path, attempt: int) -> AttemptEvidence:
        """Poll until the job exits, a rank dies, it hangs, or rlsup is asked to stop
        (:class:`supervisor.run.attempt_watch.AttemptWatch`)."""
        return self.watcher.watch(job, hb_dir, attempt)

    def cleanup(self, job: Job, evidence: AttemptEvidence, hb_dir: Path) -> list[StuckProcess]:
        """Nothing of an attempt may survive it.

        A failed attempt (crash, hang, another node's failure) is killed at once with SIGKILL: a
        half-written step is harmless by design (manifest last), its stacks are already saved, and a
        rank stuck in a collective would only turn SIGTERM into should_stop() and never act on it. What
        is left of a successful, stopped or preempted job gets SIGTERM and ``kill_grace``. Returns what outlived
        the SIGKILL (evidence for the outcome: :func:`supervisor.diagnosis.unkillable.unkillable_outcome`)."""
        graceful = job_settled(evidence.ending)
        killed = job.terminate_tree(self.settings.kill_grace if graceful else 0.0, stuck_after=self.settings.kill_grace)
        if killed:
            self._log(f"attempt {evidence.attempt}: killed leftover processes {killed}")
        from supervisor.diagnosis.unkillable import record_stuck, with_warm_ranks

        stuck = with_warm_ranks(list(job.stuck), hb_dir)  # a warm-started rank's number is in its own record
        record_stuck(evidence.attempt, stuck, self.settings.kill_grace, self._log, self.state_dir / state_files.UNKILLABLE)
        return stuck

    @staticmethod
    def _log(message: str) -> None:
        say(message)


def say(message: str) -> None:
    """The run loop's own lines, on rlsup's one logging channel (:mod:`supervisor.log`); the job's other nodes
    (:mod:`supervisor.cluster`) say theirs here too: one logger for one run."""
    log.info(message)


__all__ = ["Supervisor", "AttemptAbandoned", "NodeTiers", "RunResult", "JobStatus", "launch_env", "say"]
