"""``rlsup run`` on several nodes: coordinated restarts and one resume step for all, parts fetched from peers.

Extends the single-node loop through its hooks only: the attempt number comes from the coordinator's
round, ``prepare`` agrees on the resume step and fetches missing parts before launch, ``peer_ended``
stops this node's job when another node's attempt failed, and a failure here ends the round for all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from supervisor.config import SupervisorConfig
from supervisor.coordinator import CoordinationError, RoundCoordinator, compute_plan
from supervisor.membership import Membership
from supervisor.observer import Observer
from supervisor.replication import ReplicationEngine, newest_own_step
from supervisor.resume import ResumePoint
from supervisor.runner import AttemptResult, Supervisor
from trainer_hooks.manifest import step_dir_name


class MultiNodeSupervisor(Supervisor):
    def __init__(self, cfg: SupervisorConfig, command: Sequence[str], membership: Membership,
                 engine: ReplicationEngine, observer: Observer | None = None) -> None:
        super().__init__(cfg, command, observer)
        self.membership = membership
        self.engine = engine
        host = membership.peers[0].rpartition(":")[0]
        self._log(f"node {membership.node_rank} of {membership.size}: coordination store "
                  f"{host}:{cfg.coordinator_port}{' (hosted here)' if membership.node_rank == 0 else ''}")
        self.coordinator = RoundCoordinator(host, cfg.coordinator_port, membership.node_rank, membership.size,
                                            cfg.rendezvous_timeout)
        self._store_lost = False

    def first_attempt(self) -> int:
        return self.coordinator.join()

    def next_attempt(self, attempt: int) -> int:
        return self.coordinator.join()

    def prepare(self, attempt: int) -> ResumePoint | None:
        """Publish what we hold; node 0 plans; fetch what we lack; start together."""
        self.coordinator.publish_inventory(attempt, self.engine.inventory())
        if self.membership.node_rank == 0:
            self.coordinator.publish_plan(compute_plan(attempt, self.coordinator.inventories(attempt)))
        plan = self.coordinator.plan(attempt)
        if plan.step is None:
            self._log(f"round {attempt}: no step is complete across the nodes; starting fresh")
            resume = None
        else:
            resume = ResumePoint(plan.step, Path(self.cfg.checkpoint_dir) / step_dir_name(plan.step), "rlsup")
            need = plan.fetch.get(self.membership.node_rank, {})
            if need:
                self._log(f"round {attempt}: fetching ranks {sorted(need)} of step {plan.step} from peers")
                try:
                    self.engine.fetch(plan.step, need)
                    self.observer.resumed_from("peer")
                except Exception as e:
                    # End the round for everyone: the next round plans again from fresh inventories,
                    # in which a holder that failed verification no longer offers the part.
                    self._log(f"round {attempt}: {e}")
                    self.coordinator.end(attempt, f"node {self.membership.node_rank}: fetch failed: {e}")
                    resume = None
        self.coordinator.mark_ready(attempt)
        self.coordinator.wait_all_ready(attempt)
        return resume

    def attempt_env(self, attempt: int, resume: ResumePoint | None, hb_dir: Path) -> dict[str, str]:
        env = super().attempt_env(attempt, resume, hb_dir)
        env["RLSUP_NODE_RANK"] = str(self.membership.node_rank)
        env["RLSUP_NUM_NODES"] = str(self.membership.size)
        return env

    def peer_ended(self, attempt: int) -> str | None:
        try:
            return self.coordinator.ended(attempt)
        except Exception:  # node 0's store is gone (it finished, or it was lost): this job's own end decides
            if not self._store_lost:
                self._store_lost = True
                self._log("the coordination store on node 0 is unreachable; watching this node's job only")
            return None

    def attempt_failed(self, attempt: int, result: AttemptResult) -> None:
        if result.reason != "peer_failure":
            try:
                self.coordinator.end(attempt, f"node {self.membership.node_rank}: {result.reason} {result.detail}".strip())
            except Exception as e:  # the next join reports the unreachable store with its address
                self._log(f"could not tell the other nodes that attempt {attempt} failed: {e}")

    def give_up(self, reason: str) -> None:
        try:
            self.coordinator.abort(f"node {self.membership.node_rank}: {reason}")
        except Exception:  # the store may be gone with node 0; giving up locally is enough then
            pass

    def progress_marker(self) -> int | None:
        return newest_own_step(Path(self.cfg.checkpoint_dir), self.membership.node_rank)


__all__ = ["MultiNodeSupervisor", "CoordinationError"]
