"""Hooks the run loop calls at each event; the default does nothing, metrics override them.

Keeping these as one small interface lets the loop stay free of Prometheus (and lets tests observe).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping


class Observer:
    def state(self, state: str) -> None:
        """The job entered ``state`` (a :class:`supervisor.lifecycle.JobStatus`, a str); once per change."""

    def attempt_started(self, attempt: int, resume_step: int | None, known: bool = True) -> None:
        """An attempt was launched, resuming from ``resume_step`` (None: fresh start); ``known`` False:
        rlsup cannot know the step the trainer resumes from (steps lost are not counted)."""

    def attempt_failed(self, reason: str, last_step: int | None) -> None:
        """An attempt ended in failure for ``reason`` (one of :data:`supervisor.lifecycle.ATTEMPT_FAILURES`)."""

    def heartbeats(self, records: Mapping[int, Any], timeout_s: float) -> None:
        """Latest heartbeat records by rank, and the heartbeat timeout in force."""

    def heartbeat_timeout(self, origin: Any) -> None:
        """How the heartbeat timeout in force was reached (a :class:`supervisor.diagnosis.hang_detector.TimeoutOrigin`)."""

    def downtime(self, seconds: float) -> None:
        """Time from an attempt's failure to the next attempt's launch."""

    def checkpoint(self, step: int, written: float) -> None:
        """The newest valid checkpoint is ``step``, written at unix time ``written``."""

    def resumed_from(self, tier: str) -> None:
        """An attempt resumes from a checkpoint found in ``tier`` (local, peer, persistent)."""

    def replicated(self, peer: str, nbytes: int) -> None:
        """``nbytes`` of checkpoint data reached ``peer`` (a node rank)."""

    def replication_failed(self, peer: str) -> None:
        """A transfer to ``peer`` failed (it is retried on the next pass)."""

    def replication_lag(self, peer: str, seconds: float) -> None:
        """Age of the oldest local part not yet on ``peer`` (0: caught up)."""

    def suspect(self, node: str, why: str) -> None:
        """``node`` was named as the likely culprit of a failure (``why``: stacks, health, repeated)."""

    def flight_recorder(self, suspects: list[int]) -> None:
        """A hang's Flight Recorder verdict named ``suspects`` (ranks; empty: it named none)."""

    def node_role(self, role: str, spares_left: int) -> None:
        """This process is a ``worker`` (holds a node rank) or a ``spare``; ``spares_left``: the job's spares
        not yet used (its ``spares`` less the ranks they took)."""

    def world_nodes(self, nodes: int, job_nodes: int) -> None:
        """The job now runs on ``nodes`` of its ``job_nodes`` nodes (fewer after a shrink: ``min_nodes``); told
        once per agreed attempt on every node, never on a single node."""

    def spare_took_over(self, seconds: float) -> None:
        """This spare took a lost node's rank ``seconds`` after the attempt it was lost in ended."""

    def stragglers(self, flagged: int, ratios: Mapping[int, float]) -> None:
        """Ranks now flagged as stragglers on this node, and each rank's latest work ratio to its peers."""

    def tier(self, name: str, stalled: Callable[[], str | None]) -> None:
        """A checkpoint tier ``name`` (persistent) runs; ``stalled()`` says why it is not answering now (None:
        it answers). Read when asked (a scrape), never from the run loop."""
