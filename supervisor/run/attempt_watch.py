"""Watching one running attempt: poll until the job exits, a rank dies, a rank hangs or straggles,
another node ends the attempt, or rlsup is asked to stop; then say what was seen of its end (an
:class:`~supervisor.diagnosis.evidence.AttemptEvidence`, stacks and Flight Recorder verdict included where ranks
were stuck), for the run loop to classify once (:func:`supervisor.diagnosis.outcome.classify`).

What it does to processes goes through the :class:`~supervisor.processes.layer.Processes` (a fake one
in tests/run/test_run_loop.py); what it learns on the way (steps, heartbeat timeout, saves) goes to the
run record, the checkpoint sight and the observer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from supervisor.diagnosis.evidence import (AttemptEvidence, EndedElsewhere, Ending, ExitSeen, FlightEvidence, HangSeen,
                                           StopSeen)
from supervisor.diagnosis.outcome import error_file_for
from supervisor.run.checkpoint_sight import CheckpointSight
from supervisor.diagnosis.hang_detector import AutoTimeout, HangDetector, HangSettings, HangVerdict
from supervisor.lifecycle import EndReason, JobStatus
from supervisor.observer import Observer
from supervisor.processes.job import JobProcess
from supervisor.processes.layer import Job, Processes
from supervisor.diagnosis.step_reports import JOB_RANK, registered_ranks
from supervisor.diagnosis.rank_deaths import RankDeathWatch
from supervisor.run.record import RunRecord
from supervisor.run.settings import RunSettings
from supervisor.stop_request import StopRequest
from supervisor.diagnosis.stragglers import StragglerDetector, StragglerWatch
from rlsup_format.heartbeat_record import rank_file_name, request_stop

if TYPE_CHECKING:
    from supervisor.diagnosis.flight_recorder import Analysis, FlightVerdict
    from supervisor.run.peers import FlightRecordShare

log = logging.getLogger(__name__)


@dataclass
class AttemptWatch:
    """The watch of a run's attempts. ``peer_ended`` is polled while the job runs (how another node ended the
    attempt, when one did); ``saved`` is called when a rank's save just ended."""

    settings: RunSettings
    hang: HangSettings
    auto_timeout: AutoTimeout
    processes: Processes
    stop: StopRequest
    record: RunRecord
    sight: CheckpointSight
    observer: Observer
    node_name: str
    peer_ended: Callable[[int], EndedElsewhere | None]
    saved: Callable[[], None]
    fr_share: "FlightRecordShare | None" = None  # several nodes: FR dumps go to node 0 (supervisor.run.peers)

    def watch(self, job: Job, hb_dir: Path, attempt: int) -> AttemptEvidence:
        deaths = RankDeathWatch()
        try:
            return self._poll(job, hb_dir, attempt, deaths)
        finally:
            deaths.close()
            self.auto_timeout.persist(force=True)  # what this attempt taught, for the next rlsup too

    def with_shared_flight(self, evidence: AttemptEvidence, attempt_dir: Path | None) -> AttemptEvidence:
        """A failed attempt's evidence with the Flight Recorder's verdict across nodes, where a node asked for
        dumps in it (:meth:`supervisor.run.peers.FlightRecordShare.settle`: node 0 judges, the others wait);
        gathered before the attempt is classified, so its outcome is made once. ``attempt_dir``: where the
        verdict is saved beside the attempt."""
        if self.fr_share is None:
            return evidence
        shared = self.fr_share.settle(evidence.attempt, attempt_dir)
        return evidence if shared is None else replace(evidence, shared_flight=shared)

    def start_step(self) -> int | None:
        """The step the attempt starts from, as the hang detector's first-step rule needs it: the resumed step,
        0 for a fresh start, None where rlsup does not know (resume off: the trainer picks; a checkpoint
        that names no step)."""
        state = self.record.state
        if not self.settings.resume:
            return None
        return 0 if state.resume_dir is None else state.resume_step

    def _poll(self, job: Job, hb_dir: Path, attempt: int, deaths: RankDeathWatch) -> AttemptEvidence:
        detector = HangDetector.from_settings(hb_dir, self.hang, self.auto_timeout, self.processes.alive,
                                              self.start_step())
        stragglers = self._straggler_watch(attempt)
        oom_before = self.processes.oom_kill_count()
        first_dead: tuple[int, int] | None = None
        saves_seen = 0
        while True:
            code = job.poll()
            if code is not None:
                if code != 0 and not self.stop.asked and job.output.finished is None:
                    # A failed root: its children must not train on while the output drains (a failed
                    # attempt is SIGKILLed anyway); a success or a stop keeps cleanup's SIGTERM and grace.
                    killed = job.terminate_tree(0.0, stuck_after=self.settings.kill_grace)
                    if killed:
                        log.info(f"attempt {attempt}: job root exited with {code}; killed what it left: {killed}")
                job.output.join(timeout=2)
                return self._exit(attempt, code, job, detector, first_dead, oom_before)
            if self.stop.asked:
                return self._stop_job(attempt, job, detector)
            elsewhere = self.peer_ended(attempt)
            if elsewhere is not None:
                who = "to grow the job back" if elsewhere.reason == EndReason.RESIZED else "by another node"
                log.info(f"attempt {attempt}: ended {who} ({elsewhere.detail}); stopping this node's job")
                if self.fr_share is not None and elsewhere.reason == EndReason.PEER_FAILURE:  # where that node asked,
                    # dumps first: the ranks still wait
                    self.fr_share.peer_ended(attempt, hb_dir, [r for r in detector.records if r >= 0])
                return self._evidence(attempt, elsewhere, job, detector)
            job.refresh()
            verdict = detector.check()
            timeout, origin = detector.timeout(), detector.origin()
            self.observer.heartbeats(detector.records, timeout)
            self.observer.heartbeat_timeout(origin)
            self.record.heartbeats(timeout, detector.last_step(), origin)
            self.auto_timeout.persist()
            if verdict is not None:
                return self._hang(attempt, job, detector, verdict)
            slow = stragglers.poll(detector.records)
            if slow is not None:  # straggler_action: restart
                return self._evidence(attempt, slow, job, detector)
            if first_dead is None:
                first_dead = self._first_dead_rank(detector)
            saves = sum(rec.saves for rec in detector.records.values())
            if saves != saves_seen:
                saves_seen = saves
                self.saved()
            deaths.track((rec.rank, rec.pid) for rec in detector.records.values() if rec.pid != job.pid)
            death = None if self.stop.asked else deaths.wait(self.settings.poll_interval)
            if death is not None and job.poll() is None:
                log.info(f"attempt {attempt}: {death.describe()}; ending the attempt")
                detector.scan()  # the steps the ranks reached since the last poll (the incident's last_step)
                return self._evidence(attempt, death, job, detector, oom_rose=self._oom_rose(oom_before))

    # ------------------------------------------------------------ how it ended

    def _evidence(self, attempt: int, ending: Ending, job: Job, detector: HangDetector, *,
                  oom_rose: bool = False) -> AttemptEvidence:
        """What was seen as the attempt ended: ``ending``, with the step reached and the output's tail as of now."""
        return AttemptEvidence(attempt, ending, self.node_name, detector.last_step(), tuple(job.output.tail()),
                               oom_rose)

    def _exit(self, attempt: int, code: int, job: Job, detector: HangDetector,
              first_dead: tuple[int, int] | None, oom_before: int | None) -> AttemptEvidence:
        detector.scan()  # the last beats (the output's, where it speaks: job.output was joined)
        seen = ExitSeen(code, job.pid, first_dead, job.output.finished,
                        self.stop.reason if self.stop.asked else None, error_file_for(detector.directory))
        return self._evidence(attempt, seen, job, detector, oom_rose=self._oom_rose(oom_before))

    def _oom_rose(self, oom_before: int | None) -> bool:
        return oom_before is not None and (self.processes.oom_kill_count() or 0) > oom_before

    def _first_dead_rank(self, detector: HangDetector) -> tuple[int, int] | None:
        for rec in detector.records.values():
            if rec.pid and not self.processes.pid_exists(rec.pid):
                return rec.rank, rec.pid
        return None

    def _straggler_watch(self, attempt: int) -> StragglerWatch:
        s = self.settings
        return StragglerWatch(StragglerDetector(s.straggler_factor, s.straggler_window, self.node_name, attempt),
                              s.state_dir, s.straggler_restart, log.info, self.observer)

    def _hang(self, attempt: int, job: Job, detector: HangDetector, verdict: HangVerdict) -> AttemptEvidence:
        reason = EndReason.HANG if verdict.reason == "heartbeat_timeout" else EndReason(verdict.reason)
        # The output's record (JOB_RANK) names the job's root, a launcher: the stuck trainer is named from its stacks
        who = "the job's output" if verdict.rank == JOB_RANK else f"rank {verdict.rank} (pid {verdict.pid})" \
            if verdict.rank is not None else "no rank"
        detail = f"{who} silent for {verdict.silent_s:.2f}s > {verdict.reason} {verdict.timeout_s:.2f}s"
        detail += f" ({verdict.note})" if verdict.note else ""  # startup: no report yet, or the first step
        log.info(f"attempt {attempt}: hang detected: {detail}; dumping stacks")
        flight = self._flight_recorder(detector)  # first: py-spy pauses ranks; its analysis runs meanwhile
        if self.fr_share is not None:  # ask the other nodes for their dumps (they dump when the attempt ends)
            self.fr_share.hang(attempt, flight)
        stacks = self.processes.dump_stacks(detector.directory, detector.records)
        if self.fr_share is not None:  # after our stacks: the peers' kills break our ranks' wait
            self.fr_share.end(attempt, f"{reason} {detail}")
            self.fr_share.await_peers(attempt)  # our ranks hold the peers' in the collective until they dumped
        # Killed before the analysis is awaited: a stop (preemption) asked meanwhile finds no job to wait for.
        # The analyser is rlsup's child, not the job's: the tree kill must spare it.
        analyser = flight.child.pid if flight is not None and flight.child is not None else None
        JobProcess.helpers.update([analyser] if analyser else [])
        try:
            killed = job.terminate_tree(0.0, stuck_after=self.settings.kill_grace)
            if killed:
                log.info(f"attempt {attempt}: killed the hung job: {killed}")
            seen = self._evidence(attempt, HangSeen(reason, detail, verdict.rank, verdict.pid, stacks), job, detector)
            fr = self._finish_flight(attempt, flight, detector.directory.parent) if flight is not None else None
        finally:
            if analyser:
                JobProcess.helpers.discard(analyser)
        self._report_stacks(attempt, stacks, output_hang=verdict.rank == JOB_RANK)
        if fr is not None and fr.suspects:  # FR's suspects over the stacks': it saw the collectives themselves
            self.observer.suspect(self.node_name, "flight_recorder")
        return seen if fr is None else replace(seen, flight=FlightEvidence(fr.text, tuple(fr.suspects)))

    def _flight_recorder(self, detector: HangDetector) -> "Analysis | None":
        """Every rank's Flight Recorder dump, its analysis started (None where no rank answers: FR off, no
        trainer_hooks, no torch.distributed)."""
        from supervisor.diagnosis.flight_recorder import begin_hang_verdict

        try:
            return begin_hang_verdict(detector.directory, [r for r in detector.records if r >= 0], self.node_name)
        except Exception as e:  # noqa: BLE001 - a verdict is a bonus: the hang is handled without it
            log.warning(f"flight recorder: no verdict: {type(e).__name__}: {e}")
            return None

    def _finish_flight(self, attempt: int, flight: "Analysis", attempt_dir: Path) -> "FlightVerdict | None":
        """FR's verdict, logged first: it leads the stacks' grouping (awaited at most HANG_ANALYSE_S, and not
        once rlsup is asked to stop)."""
        from supervisor.diagnosis.flight_recorder import HANG_ANALYSE_S, finish_analysis, save_verdict

        try:
            fr = finish_analysis(flight, HANG_ANALYSE_S, lambda: self.stop.asked)
            save_verdict(fr, attempt_dir)
        except Exception as e:  # noqa: BLE001 - as above
            log.warning(f"flight recorder: no verdict: {type(e).__name__}: {e}")
            return None
        log.info(f"attempt {attempt}: {fr.text}")
        self.observer.flight_recorder(fr.suspects)
        return fr

    def _report_stacks(self, attempt: int, stacks: dict[str, str], output_hang: bool = False) -> None:
        """Lead the log with who the stacks blame (the ranks outside the majority; the classifier reads them the
        same way, :func:`supervisor.diagnosis.stack_groups.read_stacks`) and name the suspect nodes."""
        from supervisor.diagnosis.stack_groups import read_stacks

        found = read_stacks(stacks, self.node_name, output_hang)
        if found.verdict:
            log.info(f"attempt {attempt}: {found.verdict}")
        for node in found.suspect_nodes:
            self.observer.suspect(node, "stacks")

    def _stop_job(self, attempt: int, job: Job, detector: HangDetector) -> AttemptEvidence:
        """Ask the job to save and exit (stop flags + signal), wait stop_grace, then end it."""
        signum, grace = self.stop.signum, self.settings.stop_grace
        assert signum is not None
        self.record.set_state(JobStatus.STOPPING)
        detector.scan()
        for rank in detector.records:
            try:
                request_stop(detector.directory / rank_file_name(rank))
            except OSError:
                pass
        if self.stop.preempted:
            # Only ranks that registered (trainer_hooks installed the handler) get the preemption signal;
            # the job's root only where no rank did (its record is the output's: ``progress``).
            for rec in registered_ranks(detector.records).values():
                self.processes.kill(rec.pid, signum)
        else:
            job.send(signum)
        log.info(f"stopping: waiting up to {grace:.0f}s for the job to save and exit")
        code = job.wait_exit(grace)
        stacks: dict[str, str] = {}
        if code is None:  # where the ranks are stuck is what the operator needs to know next
            log.info(f"the job did not exit within stop_grace {grace:.0f}s; dumping stacks, then killing it")
            detector.scan()
            stacks = self.processes.dump_stacks(detector.directory, detector.records)
        if stacks:
            self._report_stacks(attempt, stacks)
        return self._evidence(attempt, StopSeen(self.stop.reason, code, stacks), job, detector)
