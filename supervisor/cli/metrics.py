"""Prometheus metrics for one node's supervisor, fed by the run loop's :class:`Observer` events.

Naming follows Prometheus conventions: prefix ``rlsup_``, base units (seconds, bytes), counters end
in ``_total``, and labels stay bounded (reason, state, local rank, peer, tier; never steps, paths or pids).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info, start_http_server

from supervisor import __version__
from supervisor.diagnosis.hang_detector import TIMEOUT_SOURCES
from supervisor.lifecycle import ATTEMPT_FAILURES, EndReason, JobStatus
from supervisor.membership import node_name
from supervisor.observer import Observer
from supervisor.diagnosis.step_reports import rank_label, speaking_records

if TYPE_CHECKING:
    from supervisor.config import SupervisorConfig

DEFAULT_PORT = 9778
STATES = [s.value for s in JobStatus]
REASONS = [r.value for r in ATTEMPT_FAILURES]


@dataclass(frozen=True)
class MetricsSettings:
    """The /metrics endpoint's part of the config: ``metrics_port`` (0: off), ``metrics_addr``, ``job_name``."""

    port: int = DEFAULT_PORT
    addr: str = "0.0.0.0"
    job_name: str = ""

    @classmethod
    def from_config(cls, cfg: "SupervisorConfig") -> "MetricsSettings":
        return cls(cfg.metrics_port, cfg.metrics_addr, cfg.job_name)


SUSPECT_WHY = ("stacks", "health", "repeated", "straggler", "flight_recorder")  # the `why` of rlsup_suspect_total


class SupervisorMetrics(Observer):
    """All series rlsup exports; one instance per supervisor process, on its own registry."""

    def __init__(self, job: str = "", node: str | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.node = node or node_name()
        Info("rlsup", "rlsup version and identity of this node's supervisor.", registry=r).info(
            {"version": __version__, "node": self.node, "job_name": job})
        self.job_state = Enum("rlsup_job_state", "Current state of the supervised job.", states=STATES, registry=r)
        self.attempts = Counter("rlsup_attempts_total", "Attempts launched.", registry=r)
        self.restarts = Counter("rlsup_restarts_total", "Failed attempts by reason.", ["reason"], registry=r)
        for reason in REASONS:
            self.restarts.labels(reason)
        self.hb_age = Gauge("rlsup_heartbeat_age_seconds", "Seconds since each local rank's last heartbeat.",
                            ["local_rank"], registry=r)
        self.last_step = Gauge("rlsup_last_step", "Newest step reported by any rank's heartbeat.", registry=r)
        self.hb_timeout = Gauge("rlsup_heartbeat_timeout_seconds", "Heartbeat timeout in force (learned or set).",
                                registry=r)
        self._timeout_origin_series(r)
        self.saves = Counter("rlsup_checkpoint_saves_total", "Checkpoint saves seen (save sections ended).",
                             registry=r)
        self.save_duration = Histogram("rlsup_checkpoint_save_duration_seconds", "Duration of checkpoint saves.",
                                       buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800), registry=r)
        self.ckpt_step = Gauge("rlsup_checkpoint_latest_step", "Step of the newest valid checkpoint.", registry=r)
        self.ckpt_time = Gauge("rlsup_checkpoint_latest_timestamp_seconds",
                               "Unix time the newest valid checkpoint was written.", registry=r)
        self.ckpt_age = Gauge("rlsup_checkpoint_age_seconds", "Age of the newest valid checkpoint.", registry=r)
        self.ckpt_age.set_function(lambda: time.time() - self._ckpt_written if self._ckpt_written else float("nan"))
        self.resume_seconds = Gauge("rlsup_resume_duration_seconds",
                                    "Last restart: failure to the first heartbeat of the new attempt.", registry=r)
        self.steps_lost = Histogram("rlsup_steps_lost", "Steps redone after each failure (last step - resume step).",
                                    buckets=(0, 1, 5, 10, 50, 100, 500, 1000, 5000), registry=r)
        self.downtime_total = Counter("rlsup_downtime_seconds_total",
                                      "Seconds between a failure and the next attempt's launch.", registry=r)
        self.goodput = Gauge("rlsup_goodput_ratio", "Productive training time over wall time since rlsup started.",
                             registry=r)
        self.goodput.set_function(self._goodput)
        self.repl_bytes = Counter("rlsup_replication_bytes_total", "Checkpoint bytes sent to each peer.", ["peer"],
                                  registry=r)
        self.repl_failures = Counter("rlsup_replication_failures_total", "Failed transfers per peer.", ["peer"],
                                     registry=r)
        self.repl_lag = Gauge("rlsup_replication_lag_seconds",
                              "Age of the newest local checkpoint not yet on this peer (0: caught up).", ["peer"],
                              registry=r)
        self.resume_tier = Counter("rlsup_resumes_total", "Resumes by where the checkpoint came from.", ["tier"],
                                   registry=r)
        self.stragglers_now = Gauge("rlsup_stragglers", "Ranks of this node now flagged as stragglers.", registry=r)
        self.straggler_ratio = Gauge("rlsup_straggler_ratio", "Each rank's own work per step over its peers' median.",
                                     ["local_rank"], registry=r)
        self.suspects = Counter("rlsup_suspect_total", "Times a node was named the likely culprit of a failure.",
                                ["node", "why"], registry=r)
        for why in SUSPECT_WHY:  # pre-created at 0 for this node, so increase() sees the first one
            self.suspects.labels(self.node, why)
        self.fr_suspect = Gauge("rlsup_flight_recorder_suspect_rank",
                                "The rank the last hang's Flight Recorder verdict named (-1: none named).",
                                registry=r)
        self.fr_suspect.set(-1)
        self._job_nodes_series(r)
        self.tier_stalled = Gauge("rlsup_tier_stalled",
                                  "1 while a checkpoint tier's copy or read is named stalled (a hung or slow store).",
                                  ["tier"], registry=r)
        self.tier_stalled.labels("persistent").set(0)  # exported from the start, so an alert sees 0 before 1
        self._started = time.monotonic()
        self._ckpt_written = 0.0
        self._productive = 0.0
        self._running_since: float | None = None
        self._failed_at: float | None = None
        self._failed_step: int | None = None
        self._awaiting_first_beat = False
        self._step_time = 0.0
        self._prev_step: tuple[int, float] | None = None
        self._saves_seen: dict[int, int] = {}  # pid -> saves counted
        self._ranks_seen: set[int] = set()

    def _timeout_origin_series(self, r: CollectorRegistry) -> None:
        """How the heartbeat timeout in force was reached (docs/hangs.md)."""
        self.hb_timeout_source = Enum("rlsup_heartbeat_timeout_source", "How the heartbeat timeout in force was "
                                      "reached: initial (still learning), learned, or explicit (set).",
                                      states=list(TIMEOUT_SOURCES), registry=r)
        self.hb_timeout_intervals = Gauge("rlsup_heartbeat_timeout_intervals", "Step intervals the learned heartbeat "
                                          "timeout is from (while initial: those seen so far).", registry=r)
        self.hb_stalls = Gauge("rlsup_heartbeat_stalls", "Step intervals held as stalls the job survived (a "
                               "partition, a blip): counted, not learned into the heartbeat timeout.", registry=r)

    def _job_nodes_series(self, r: CollectorRegistry) -> None:
        """The job's nodes: this process's role, the spares left, and the nodes the running world spans."""
        self.role = Enum("rlsup_node_role", "What this node process does: worker (holds a node rank) or spare.",
                         states=["worker", "spare"], registry=r)
        self.spares_left = Gauge("rlsup_spares_left", "The job's spare nodes not yet used (spares less ranks taken).",
                                 registry=r)
        self.takeover = Gauge("rlsup_spare_takeover_seconds", "Last takeover by this spare: from the end of the "
                              "attempt its node was lost in to its claim of the rank (the next attempt's first "
                              "heartbeat is rlsup_resume_duration_seconds on the other nodes).", registry=r)
        self.running_nodes = Gauge("rlsup_world_nodes", "Nodes the job's running world spans: below rlsup_job_nodes "
                                   "after a shrink (min_nodes); 0 on a single node.", registry=r)
        self.launched_nodes = Gauge("rlsup_job_nodes", "Nodes the job was launched for (peers less spares); 0 on a "
                                    "single node.", registry=r)

    # ------------------------------------------------------------ HTTP

    def serve(self, addr: str, port: int) -> int:
        """Start the /metrics endpoint; returns the bound port (useful with port 0)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_address[1])

    # ------------------------------------------------------------ Observer events

    def state(self, state: str) -> None:
        self.job_state.state(state)
        now = time.monotonic()
        if state == "running":
            self._running_since = now
        elif self._running_since is not None:
            self._productive += now - self._running_since
            self._running_since = None

    def attempt_started(self, attempt: int, resume_step: int | None, known: bool = True) -> None:
        self.attempts.inc()
        self._awaiting_first_beat = self._failed_at is not None
        if self._failed_step is not None and known:
            lost = max(0, self._failed_step - (resume_step or 0))
            self.steps_lost.observe(lost)
            self._productive -= lost * self._step_time  # work that has to be done again was not productive
        self._prev_step = None
        for rank in self._ranks_seen:
            self.hb_age.remove(rank_label(rank))
        self._ranks_seen.clear()

    def attempt_failed(self, reason: str, last_step: int | None) -> None:
        self.restarts.labels(reason if reason in REASONS else EndReason.EXIT_CODE.value).inc()
        self._failed_at = time.monotonic()
        self._failed_step = last_step

    def heartbeats(self, records: Mapping[int, Any], timeout_s: float) -> None:
        now_ns = time.monotonic_ns()
        self.hb_timeout.set(timeout_s)
        steps = []
        records = speaking_records(records)  # not the output's record beside the ranks' (it never saves)
        for gone in self._ranks_seen - records.keys():  # the output's record, once ranks beat themselves
            self.hb_age.remove(rank_label(gone))
            self._ranks_seen.discard(gone)
        for rank, rec in records.items():
            if rec.beat_ns:
                self.hb_age.labels(rank_label(rank)).set(max(0.0, (now_ns - rec.beat_ns) / 1e9))
                self._ranks_seen.add(rank)
                steps.append(rec.step)
            if rank == min(records):  # count each save once (every rank saves), by the lowest rank
                new = rec.saves - self._saves_seen.get(rec.pid, 0)
                if new > 0:
                    self.saves.inc(new)
                    self.save_duration.observe(rec.save_ns / 1e9)
                self._saves_seen[rec.pid] = rec.saves
        if steps:
            step = max(steps)
            self.last_step.set(step)
            now = time.monotonic()
            if self._prev_step is not None and step > self._prev_step[0]:
                self._step_time = (now - self._prev_step[1]) / (step - self._prev_step[0])
            if self._prev_step is None or step != self._prev_step[0]:
                self._prev_step = (step, now)
            if self._awaiting_first_beat and self._failed_at is not None:
                self.resume_seconds.set(now - self._failed_at)
                self._awaiting_first_beat = False

    def heartbeat_timeout(self, origin: Any) -> None:
        self.hb_timeout_source.state(origin.source)
        self.hb_timeout_intervals.set(origin.intervals)
        self.hb_stalls.set(origin.stalls)

    def downtime(self, seconds: float) -> None:
        self.downtime_total.inc(seconds)

    def checkpoint(self, step: int, written: float) -> None:
        """The newest valid checkpoint is ``step``, written at unix time ``written``."""
        self.ckpt_step.set(step)
        self.ckpt_time.set(written)
        self._ckpt_written = written

    def replicated(self, peer: str, nbytes: int) -> None:
        self.repl_bytes.labels(peer).inc(nbytes)

    def replication_failed(self, peer: str) -> None:
        self.repl_failures.labels(peer).inc()

    def replication_lag(self, peer: str, seconds: float) -> None:
        self.repl_lag.labels(peer).set(seconds)

    def resumed_from(self, tier: str) -> None:
        self.resume_tier.labels(tier).inc()

    def stragglers(self, flagged: int, ratios: Mapping[int, float]) -> None:
        self.stragglers_now.set(flagged)
        for rank, ratio in ratios.items():
            self.straggler_ratio.labels(str(rank)).set(ratio)

    def suspect(self, node: str, why: str) -> None:
        self.suspects.labels(node, why).inc()  # node names, not pids: the label set stays bounded

    def flight_recorder(self, suspects: list[int]) -> None:
        self.fr_suspect.set(min(suspects) if suspects else -1)  # a value, not a label: ranks are unbounded

    def node_role(self, role: str, spares_left: int) -> None:
        self.role.state(role)
        self.spares_left.set(spares_left)

    def spare_took_over(self, seconds: float) -> None:
        self.takeover.set(seconds)

    def world_nodes(self, nodes: int, job_nodes: int) -> None:
        self.running_nodes.set(nodes)
        self.launched_nodes.set(job_nodes)

    def tier(self, name: str, stalled: Callable[[], str | None]) -> None:
        self.tier_stalled.labels(name).set_function(lambda: 1.0 if stalled() is not None else 0.0)

    def _goodput(self) -> float:
        wall = time.monotonic() - self._started
        productive = self._productive
        if self._running_since is not None:
            productive += time.monotonic() - self._running_since
        return max(0.0, min(1.0, productive / wall)) if wall > 0 else 0.0
