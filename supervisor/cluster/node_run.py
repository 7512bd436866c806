"""One node's ``rlsup run`` in a job of several: the run loop composed with the job's other nodes.

The wiring, in order: the command pinned to this node's rank, the store reached (``connect``, under the stop's
handlers: SIGTERM while node 0 is awaited stops rlsup as anywhere else), this node's tiers built once, the nodes
(:class:`supervisor.cluster.multinode.NodeGroup`) and the loop (:class:`supervisor.run.loop.Supervisor`) built
with them, and the loop run. What ends a run for coordination reasons (a job that finished without this node, a
node lost before the first attempt, a clash, a timeout, rlsup's own error in the first round) is handled here,
around the loop: the loop records the give-up, this module says what it means for the job and its store.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from supervisor import exit_codes
from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.cluster.round_errors import CoordinationError, JobClash, NodesMissing, PeerLost
from supervisor.cluster.fr_exchange import FrExchange
from supervisor.cluster.job_store import CoordinatorSettings
from supervisor.cluster.multinode import NodeGroup
from supervisor.cluster.round_lead import RoundRole, ShrinkSettings, round_role
from supervisor.cluster.spares import JobEnded, JobEndWatch, SpareSeat, moved_slots, spares_left
from supervisor.job_identity import JobIdentity
from supervisor.launch.rank_pinning import pin_ranks, resizable_launch
from supervisor.launch.warm_start import WarmStarts
from supervisor.lifecycle import JobStatus
from supervisor.membership import Membership, node_name
from supervisor.observer import Observer
from supervisor.processes.layer import Processes
from supervisor.run.loop import NodeTiers, Supervisor, say
from supervisor.run.record import RunResult
from supervisor.run.settings import RunSettings
from supervisor.stop_request import StopAsked, StopRequest
from supervisor.tiers.replication import ReplicationEngine

if TYPE_CHECKING:
    from supervisor.config import SupervisorConfig

log = logging.getLogger(__name__)

# Node 0 of a job ended by another node's clash keeps its store up this long: a node of the *other* job that
# shares the port and connects late reads whose store it is and refuses, instead of waiting for a store
# that nobody will host again. A stop ends the wait at once.
CLASH_LINGER_S = 10.0
# A node that ends the first round for a lost peer clears its keys this long after (supervisor.cluster.liveness): by then
# every node of the round saw ``abort`` (each looks twice a second) or ends on its own lapse rule.
JOB_END_LINGER_S = 3.0  # the lead of a smaller world keeps the job's keys this long after its end (see _job_done)
LOST_LINGER_S = 3.0
Connect = Callable[[StopRequest], RoundCoordinator]  # reaches the job's store; every wait asks the stop


@dataclass(frozen=True)
class NodeRunSettings:
    """What a node's run reads around its loop: the loop's own settings (``run``: the stop's signal, the
    directories, the poll interval) and the job's store (``store``: node 0 hosts the embedded one)."""

    run: RunSettings
    store: CoordinatorSettings
    shrink: ShrinkSettings = ShrinkSettings()

    @classmethod
    def from_config(cls, cfg: SupervisorConfig) -> "NodeRunSettings":
        """``cfg`` resolved (absolute paths)."""
        return cls(RunSettings.from_config(cfg), CoordinatorSettings.from_config(cfg), ShrinkSettings.from_config(cfg))


class NewLoop(Protocol):
    """Builds this node's run loop over the job's other nodes (``peers``), as :class:`Supervisor` is built: the
    loop is made once the store is reached, and only its builder knows the loop's config."""

    def __call__(self, command: Sequence[str], observer: Observer, *, job: JobIdentity,
                 processes: Processes | None, peers: NodeGroup, tiers: NodeTiers, stop: StopRequest,
                 warm: WarmStarts | None) -> Supervisor: ...


class NodeRun:
    """This node's run: call :meth:`run` once. :meth:`from_config` builds it as the command line does.

    ``tiers``: this node's checkpoint tiers, shared by its loop and the job's other nodes. ``new_loop``: builds
    the loop once the store is reached. ``coordinator``: the job's store, reached; or ``connect``, which
    :meth:`run` calls. ``stop``: the run's stop request, its signal handlers installed by the caller (the command
    line's, from before this node's start-up, so that one installation covers it all); None: this run makes its
    own and installs it for :meth:`run`. ``spares``: this node's claim on its rank, checked at every join.
    ``warm``: a spare's launcher, armed while it waited, used (and discarded at the end) instead of a fresh one."""

    def __init__(self, settings: NodeRunSettings, command: Sequence[str], membership: Membership,
                 engine: ReplicationEngine, observer: Observer | None = None, *, job: JobIdentity, tiers: NodeTiers,
                 new_loop: NewLoop, coordinator: RoundCoordinator | None = None, connect: Connect | None = None,
                 processes: Processes | None = None, stop: StopRequest | None = None,
                 spares: SpareSeat | None = None, warm: WarmStarts | None = None) -> None:
        if coordinator is None and connect is None:
            raise ValueError("a node's run needs a coordinator or a way to connect to one")
        self.settings = settings
        self.new_loop = new_loop
        master = membership.peers[0].rpartition(":")[0]
        pinned = pin_ranks(command, membership.node_rank, membership.size, master)
        self.command, self.membership, self.engine, self.job = pinned.command, membership, engine, job
        self.observer = observer or Observer()
        self.coordinator, self.connect = coordinator, connect
        self.processes, self.spares, self.warm = processes, spares, warm
        self.installs_stop = stop is None
        self.stop = stop or StopRequest(self.settings.run.preempt_signal)
        self.tiers = tiers
        if pinned.note:
            say(pinned.note)

    @classmethod
    def from_config(cls, cfg: SupervisorConfig, command: Sequence[str], membership: Membership,
                    engine: ReplicationEngine, observer: Observer | None = None, *, job: JobIdentity,
                    coordinator: RoundCoordinator | None = None, connect: Connect | None = None,
                    processes: Processes | None = None, stop: StopRequest | None = None,
                    spares: SpareSeat | None = None, warm: WarmStarts | None = None) -> "NodeRun":
        """The run's settings, this node's tiers and its loop's builder, each made once from ``cfg``; the run
        itself never reads the config."""
        cfg = cfg.resolved()
        # The tiers are this node's (node 0 alone starts and prunes persistent steps; the memory tier holds this
        # node's own directory and ranks), built once and shared by the loop and the nodes.
        tiers = NodeTiers.from_config(cfg, job.id, membership.node_rank, membership.size)
        return cls(NodeRunSettings.from_config(cfg), command, membership, engine, observer, job=job, tiers=tiers,
                   new_loop=partial(Supervisor, cfg), coordinator=coordinator, connect=connect,
                   processes=processes, stop=stop, spares=spares, warm=warm)

    def request_stop(self, signum: int, preempted: bool = False) -> None:
        """Stop the run (from any thread but a signal handler), as :meth:`Supervisor.request_stop`."""
        self.stop.ask(signum, preempted)

    def run(self) -> RunResult:
        previous = self.stop.install() if self.installs_stop else {}
        try:
            return self._run()
        finally:
            self.stop.restore(previous)

    def _run(self) -> RunResult:
        try:
            coordinator = self.coordinator or self._connect()
        except StopAsked as e:
            say(f"{e}; no attempt was started")
            status = JobStatus.PREEMPTED if self.stop.preempted else JobStatus.STOPPED
            return RunResult(e.exit_code, status, 0, [])
        # Any other failure to reach the store goes to the command line as it is: nothing ran, so nothing is
        # recorded (a give-up here would overwrite the state a predecessor left, and flush tiers never started).
        self._say_store(coordinator)
        group = self.group(coordinator)
        loop = self.loop(group)
        try:
            result = loop.run()
        except CoordinationError as e:
            return self._coordination_ended(loop, coordinator, e)
        except StopAsked:
            raise
        except Exception as e:
            tell_peers_of_error(coordinator, self.membership.node_rank, e)
            raise
        finally:
            leave_first_round(coordinator)
        if result.status is JobStatus.SUCCEEDED:
            world = group.world()
            self._job_done(coordinator, group.role, group.job_end, result, world.nodes < world.job_nodes)
        return result

    def _connect(self) -> RoundCoordinator:
        assert self.connect is not None
        return self.connect(self.stop)

    def group(self, coordinator: RoundCoordinator) -> NodeGroup:
        """The job's other nodes as this node's loop sees them, over ``coordinator``."""
        rank, size = self.membership.node_rank, self.membership.size
        # A hang's Flight Recorder dumps meet on node 0, which judges them all (supervisor.cluster.fr_exchange).
        fr = FrExchange(coordinator, rank, size, node_name(), self.observer, stopped=lambda: self.stop.asked)
        run = self.settings.run
        seat = self.spares is not None  # a job with spares can finish without this node (supervisor.cluster.spares)
        shrink = self.settings.shrink
        if shrink.floor(size) is not None and not resizable_launch(self.command):
            say(f"min_nodes {shrink.min_nodes}: the launch line is not torchrun's, whose node count rlsup can rewrite; "
                "this job is never run on fewer nodes")
            shrink = replace(shrink, min_nodes=0)
        # a job that can finish without this node (a spare or a smaller world ran on) leaves a record of its end
        ends_without_me = seat or shrink.floor(size) is not None
        job_end = (JobEndWatch.attach(coordinator, run.checkpoint_dir, self.tiers.persistent, self.job)
                   if ends_without_me else None)
        seat_of = self.spares

        def unused_spares() -> int:  # a spare takes a lost node's rank first: the job shrinks only when none is left
            return 0 if seat_of is None else spares_left(seat_of.roster, moved_slots(coordinator, size))
        engine = self.engine
        role = round_role(rank, coordinator, self.tiers.persistent, say, shrink, unused_spares,
                          lambda: engine.membership.peers,  # a spare's endpoint once it took a rank (move_peer)
                          self.settings.store.outlives_node_0)
        return NodeGroup(self.membership, self.engine, coordinator, role,
                         fr, self.stop, self.tiers, run.checkpoint_dir, run.state_dir, say,
                         observer=self.observer, spares=self.spares, job_end=job_end)

    def loop(self, group: NodeGroup) -> Supervisor:
        """The run loop of this node, with the job's other nodes as ``group``."""
        return self.new_loop(self.command, self.observer, job=self.job, processes=self.processes, peers=group,
                             tiers=self.tiers, stop=self.stop, warm=self.warm)

    def _say_store(self, coordinator: RoundCoordinator) -> None:
        hosted = self.settings.store.hosted_by(self.membership.node_rank)
        say(f"node {self.membership.node_rank} of {self.membership.size}, job {self.job}: coordination store "
            f"{coordinator.describe()}{' (hosted here)' if hosted else ''}")

    def _coordination_ended(self, loop: Supervisor, coordinator: RoundCoordinator,
                            e: CoordinationError) -> RunResult:
        """The nodes could not agree (a timeout, an abort, a clash, a node lost before the first attempt, the job
        over without this node): the loop records the give-up with the command line's exit code (2: a clash, 75:
        a lost node, the job is requeued, 0: the job finished without this node, 1 otherwise). Returns for a job
        that finished without this node and for a node lost before the first attempt; raises the others."""
        codes = {JobClash: exit_codes.CONFIG_ERROR, PeerLost: exit_codes.REQUEUE, NodesMissing: exit_codes.REQUEUE,
                 JobEnded: exit_codes.OK}
        code = next((c for kind, c in codes.items() if isinstance(e, kind)), exit_codes.FAILED)
        if isinstance(e, JobEnded):  # a spare ran this node's rank to the end: nothing to requeue
            say(f"{e}; exiting {exit_codes.OK} (the job succeeded without this node; nothing to requeue)")
            return loop.give_up_outside_attempt(code, str(e))
        if isinstance(e, PeerLost):  # before the first attempt: nothing ran, nothing is lost; requeue the job
            say(f"{e}; exiting {exit_codes.REQUEUE} so that the scheduler requeues the job")
            done = loop.give_up_outside_attempt(code, str(e))
            self._forget_lost_round(coordinator)
            return done
        if isinstance(e, NodesMissing):  # a node lost after the job ran, and the job cannot go on without it
            say(f"{e}; exiting {exit_codes.REQUEUE} so that the scheduler requeues the job (every checkpoint is kept)")
            return loop.give_up_outside_attempt(code, str(e))
        loop.give_up_outside_attempt(code, str(e))
        if isinstance(e, JobClash):
            self._linger_after_clash()
        raise e

    def _job_done(self, coordinator: RoundCoordinator, role: RoundRole, job_end: JobEndWatch | None,
                  result: RunResult, smaller: bool = False) -> None:
        """The job succeeded: the lead records its end and tells the spares (its role's duty); the store forgets the
        job's keys. ``smaller``: it ended on fewer nodes than the job's, and a node left out of it may be waiting to
        grow back: the lead leaves ``done`` in the store for :data:`JOB_END_LINGER_S` first (that node looks every
        second, and may see no record of the end on its own disks)."""
        try:
            role.finish_job(job_end, result.attempts - 1)  # the attempt that finished (attempts: a count)
            if smaller and role.leads:
                self.stop.wait(JOB_END_LINGER_S, self.settings.run.poll_interval)
            coordinator.finish(result.attempts - 1)  # a store that outlives the job (etcd) forgets its keys
        except Exception as e:  # noqa: BLE001 - the job is done; stale keys are ignored by the next run
            say(f"could not clear the job's coordination keys: {e}")

    def _forget_lost_round(self, coordinator: RoundCoordinator) -> None:
        """After :class:`PeerLost`: wait :data:`LOST_LINGER_S` (every node looks at ``abort`` twice a second), then
        clear the round's keys (:meth:`RoundCoordinator.forget_first_round`). A stop ends the wait at once."""
        self.stop.wait(LOST_LINGER_S, self.settings.run.poll_interval)
        try:
            coordinator.forget_first_round()
        except Exception as e:  # noqa: BLE001 - the store is gone: the embedded one took its keys with it
            say(f"could not clear the first round's keys: {e}")

    def _linger_after_clash(self) -> None:
        """The node that hosts the embedded store, ended by another node's clash: see :data:`CLASH_LINGER_S`."""
        if self.settings.store.hosted_by(self.membership.node_rank):
            say(f"a node of this job refused to start for a clash; keeping the store up {CLASH_LINGER_S:.0f}s "
                "so that the other job's nodes that reach it learn whose it is")
            self.stop.wait(CLASH_LINGER_S, self.settings.run.poll_interval)


def tell_peers_of_error(coordinator: RoundCoordinator, node_rank: int, e: Exception) -> None:
    """rlsup's own error (a bug, a deterministic crash) in the job's first round ends the job for every node
    as a give-up (exit 1), naming this node and the error: without a word its peers would take it for a node
    lost in the first round (exit 75, requeued for ever). A node that vanishes without a word (SIGKILL,
    power) is still a lost one; so is a node whose rlsup fails once the job has run: a replacement or a spare
    takes its place, as for any lost node."""
    if not coordinator.first_round:
        return
    why = f"node {node_rank}: rlsup failed: {type(e).__name__}: {e}"
    say(f"{why}; ending the job for every node")
    try:
        coordinator.abort(why)
    except Exception as err:  # noqa: BLE001 - the store is gone: the peers' own waits end on that
        say(f"could not tell the other nodes: {err}")


def leave_first_round(coordinator: RoundCoordinator) -> None:
    """A run that ends inside the job's first round (a stop, a give-up, an error) deletes this node's beat:
    a requeued run in a store that outlives this one (etcd) must not count it (:mod:`supervisor.cluster.liveness`)."""
    if not coordinator.first_round:
        return
    try:
        coordinator.end_first_round(clear=True)
    except Exception as e:  # noqa: BLE001 - the store is gone (the embedded one goes with node 0): nothing stays
        say(f"could not delete this node's liveness beat: {e}")


__all__ = ["NodeRun", "NodeRunSettings", "NewLoop", "Connect", "CLASH_LINGER_S", "LOST_LINGER_S", "tell_peers_of_error", "leave_first_round"]
