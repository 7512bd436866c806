"""Several nodes' agreement round in one process: each simulated node runs the real round
(:meth:`supervisor.cluster.multinode.NodeGroup.join` and :meth:`~supervisor.cluster.multinode.NodeGroup.agree`: the
inventory, node 0's :class:`~supervisor.cluster.round_lead.RoundLead` and ``compute_plan``, the fetches through
:func:`supervisor.tiers.part_protocol.fetch_part`, the fetch results, ready) on its own thread, over one
:class:`support.memory_kvstore.MemoryKVStore`, each node with its own directories of real rlsup-layout parts
(written by the trainer's own writer, :func:`trainer_hooks.step_writer.write_step`).

What is not real: a peer is reached in process. Where a node's supervisor would read a peer's replica namespace over
HTTP (:class:`supervisor.tiers.part_stores.peer.PeerStore`, from ``ReplicationEngine.peer_store``), it reads the
same directory on the peer's disk through a :class:`supervisor.tiers.part_stores.local.LocalStore`
(:class:`HolderStore`, which also records every read and injects a holder's failure); :class:`RoundEngine` is the
node's real :class:`~supervisor.tiers.replication.ReplicationEngine` with that one method replaced by composition.
Replicas and persistent copies are put in place with the real :func:`~supervisor.tiers.part_protocol.copy_part`.
"""

from __future__ import annotations

import errno
import io
import shutil
import signal
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import BinaryIO, Callable, ContextManager

import torch

from rlsup_format.digest import FileEntry
from rlsup_format.manifest import KnownDigests, RankManifest, StepReader
from rlsup_format.names import step_dir_name
from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.cluster.fr_exchange import FrExchange
from supervisor.cluster.multinode import NodeGroup
from supervisor.cluster.round_lead import ShrinkSettings, round_role
from supervisor.cluster.spares import JobEndWatch
from supervisor.job_identity import JobIdentity, namespace_of
from supervisor.membership import Membership, replica_targets
from supervisor.observer import Observer
from supervisor.run.loop import NodeTiers
from supervisor.stop_request import StopRequest
from supervisor.tiers.holdings import NodeInventory, RoundPlan
from supervisor.tiers.memory_tier import MemorySettings, MemoryTier, job_memory_dir
from supervisor.tiers.part_protocol import PartStore, copy_part
from supervisor.tiers.part_stores.local import LocalStore
from supervisor.tiers.persistent import PersistentSettings, PersistentTier
from supervisor.tiers.replication import ReplicationEngine
from supervisor.tiers.resume import ResumePoint
from support.memory_kvstore import MemoryKVStore
from support.waits import in_thread
from trainer_hooks.backends import get_backend
from trainer_hooks.step_writer import RankIdentity, StepTarget, write_step

JOB = JobIdentity("round-in-process", "tests/support/in_process_round.py")
SECRET = b"in-process-round-secret-0123456789"
NEVER_SHRINK = ShrinkSettings()  # min_nodes unset: the job's size
ROUND_TIMEOUT_S = 10.0  # rendezvous_timeout of every node's coordinator: a missing key fails the test, not hangs it


class Fault(str, Enum):
    """How a holder's copy fails when a node fetches from it, after the plan was made."""

    NONE = "none"
    UNREACHABLE = "unreachable"  # every read raises, as a peer whose daemon went away mid-round
    CORRUPT = "corrupt"  # data files arrive with a flipped byte, as a replica rotted after the inventory


@dataclass(frozen=True)
class Read:
    """One data file ``node`` read from a holder of its parts (``holder``: a node rank, or ``"persistent"``)."""

    holder: int | str
    node: int
    step: int
    name: str


class HolderStore:
    """A :class:`~supervisor.tiers.part_protocol.PartStore` over ``holder``'s copy of node ``node``'s parts (a peer's
    replica namespace on its disk, read in process; or the persistent tier's store), as ``node`` reaches it: each
    data file opened is recorded in ``reads``; ``fault`` makes the reads fail (see :class:`Fault`)."""

    def __init__(self, inner: PartStore, holder: int | str, node: int, reads: list[Read],
                 fault: Fault = Fault.NONE) -> None:
        self.inner, self.holder, self.node, self.reads, self.fault = inner, holder, node, reads, fault
        self.location = f"node {holder}" if isinstance(holder, int) else f"{holder} tier"

    def steps(self) -> list[int]:
        return self.inner.steps()

    def reader(self, step: int) -> StepReader:
        return self.inner.reader(step)

    def open(self, step: int, name: str) -> BinaryIO:
        self.reads.append(Read(self.holder, self.node, step, name))
        if self.fault is Fault.UNREACHABLE:
            raise ConnectionResetError(errno.ECONNRESET, f"{self.location}: connection reset by peer")
        with self.inner.open(step, name) as f:
            data = bytearray(f.read())
        if self.fault is Fault.CORRUPT and data:
            data[len(data) // 2] ^= 0xFF
        return io.BytesIO(bytes(data))

    def put_file(self, step: int, name: str, src: BinaryIO, entry: FileEntry) -> None:
        self.inner.put_file(step, name, src, entry)

    def put_manifest(self, step: int, rank: int, raw: bytes) -> None:
        self.inner.put_manifest(step, rank, raw)

    def remove_manifest(self, step: int, rank: int) -> None:
        self.inner.remove_manifest(step, rank)

    def delete(self, step: int) -> None:
        self.inner.delete(step)

    def clean(self) -> None:
        self.inner.clean()

    def hold(self, step: int) -> ContextManager[None]:
        return self.inner.hold(step)


class RoundEngine:
    """What :class:`NodeGroup` asks of a node's replication engine: the real ``engine`` for everything (inventory,
    checkpoint directory, the job check, cleaning) but the peers, which ``peer_store`` reaches in process."""

    def __init__(self, engine: ReplicationEngine, peer_store: Callable[[int], PartStore],
                 holder_store: Callable[[int, int], PartStore]) -> None:
        self.engine, self._peer_store, self._holder_store = engine, peer_store, holder_store

    @property
    def membership(self) -> Membership:
        return self.engine.membership

    def inventory(self, known: KnownDigests | None = None) -> NodeInventory:
        return self.engine.inventory(known=known)

    def local_store(self) -> LocalStore:
        return self.engine.local_store()

    def accept(self, manifest: RankManifest) -> str:
        return self.engine.accept(manifest)

    def clean(self) -> None:
        self.engine.clean()

    def move_peer(self, node: int, endpoint: str) -> bool:
        return self.engine.move_peer(node, endpoint)

    def peer_store(self, node: int) -> PartStore:
        return self._peer_store(node)

    def holder_store(self, holder: int, owner: int) -> PartStore:
        return self._holder_store(holder, owner)

    def replicated(self, step: int) -> bool:
        """The simulation copies replicas itself (:meth:`SimCluster.replicate`) before it asks: always."""
        return True


@dataclass(frozen=True)
class NodeOutcome:
    """What one node's round ended with: the attempt it joined, and the resume point agreed or the error."""

    node: int
    attempt: int | None
    resume: ResumePoint | None
    error: BaseException | None
    lines: tuple[str, ...]


@dataclass
class SimNode:
    """One simulated node's directories (all under ``root``) and tiers."""

    rank: int
    root: Path
    memory: MemoryTier | None = None
    persistent: PersistentTier | None = None
    lines: list[str] = field(default_factory=list)

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpt"

    @property
    def replica_root(self) -> Path:
        return self.root / "replicas"

    def replicas_of(self, owner: int) -> Path:
        """Where this node holds ``owner``'s parts (the transport's ``<replica root>/<job>.node<owner>``)."""
        return self.replica_root / namespace_of(JOB.id, owner)

    def wipe(self) -> None:
        """The node lost its disks (a replacement with empty ones): checkpoint, replicas, memory tier."""
        shutil.rmtree(self.root)
        self.root.mkdir()


class SimCluster:
    """``nodes`` simulated nodes of ``ranks_per_node`` ranks each (torchrun's contiguous blocks), sharing one
    in-memory store; ``memory``/``persistent``: every node has that tier. ``faults[(holder, owner)]``: how
    ``holder``'s copy of ``owner``'s parts fails when fetched. ``store``: the shared store (default: a plain one)."""

    def __init__(self, tmp: Path, nodes: int = 3, ranks_per_node: int = 2, *, memory: bool = False,
                 persistent: bool = False, store: MemoryKVStore | None = None,
                 shrink: ShrinkSettings = NEVER_SHRINK, etcd_like: bool = False, probe: bool = False) -> None:
        """``shrink``: the lead's rule for going on with fewer nodes (``min_nodes``; default never); ``etcd_like``: the
        store outlives node 0 (as etcd does), so the job may go on without node 0 too; ``probe``: a missing node's
        endpoint is probed (nothing listens on the peers' ports: refused), else never."""
        self.size, self.per_node, self.world = nodes, ranks_per_node, nodes * ranks_per_node
        self.shrink, self.etcd_like, self.probe = shrink, etcd_like, probe
        self.groups: dict[int, NodeGroup] = {}
        self.store = store or MemoryKVStore(tmp.name)
        self.reads: list[Read] = []
        self.faults: dict[tuple[int, int], Fault] = {}
        self.persistent_dir = tmp / "persistent" / JOB.id
        # never dialled (a missing node's is probed: refused); a host each, as torchrun's master address is a node's
        self.peers = tuple(f"127.0.0.{n + 1}:{9000 + n}" for n in range(nodes))
        self.nodes = []
        for n in range(nodes):
            node = SimNode(n, tmp / f"node{n}")
            node.root.mkdir(parents=True)
            if memory:
                node.memory = MemoryTier(MemorySettings(job_memory_dir(node.root / "shm", JOB.id, n), node=n,
                                                        nodes=nodes), node.ckpt, JOB.id)
            if persistent:  # one shared directory; each node's tier object reads it through a recording store
                node.persistent = PersistentTier(PersistentSettings.make(self.persistent_dir, source=node.ckpt, node=n))
                node.persistent.store = HolderStore(node.persistent.store, "persistent", n, self.reads)
            self.nodes.append(node)

    # ------------------------------------------------------------ what the nodes hold before the round

    def ranks_of(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)

    def save(self, step: int, nodes: list[int] | None = None, *, memory: bool = False,
             ranks: list[int] | None = None, resizable: bool = False, world: list[int] | None = None) -> None:
        """The nodes' ranks (``ranks``: only those) write their parts of ``step`` with the trainer's writer, into
        each node's checkpoint directory or (``memory``) its memory tier; ``resizable``: marked restorable into
        another world size. ``world``: the nodes that run the job now (default all): a smaller world's ranks are
        numbered over them, the i-th running node's block the i-th."""
        running = list(range(self.size)) if world is None else world
        for n in running if nodes is None else nodes:
            node = self.nodes[n]
            directory = node.memory.root if memory and node.memory is not None else node.ckpt
            index = running.index(n)
            for rank in range(index * self.per_node, (index + 1) * self.per_node):
                if ranks is None or rank in ranks:
                    payload = {"w": torch.full((512,), float(step * 100 + rank)), "step": step}
                    write_step(StepTarget(directory, resizable=resizable), step, payload,
                               RankIdentity(rank, len(running) * self.per_node, n, JOB.id), get_backend("torch"))

    def replicate(self, step: int, factor: int = 1, nodes: list[int] | None = None,
                  ranks: list[int] | None = None, world: list[int] | None = None) -> None:
        """Each node's parts of ``step`` (``ranks``: only those) copied to its replica targets (the ring of
        ``replication_factor``), as its replication engine pushes them; ``world``: as for :meth:`save`."""
        running = list(range(self.size)) if world is None else world
        for n in running if nodes is None else nodes:
            src = LocalStore(self.nodes[n].ckpt)
            index = running.index(n)
            for target in replica_targets(n, self.size, factor):
                dst = LocalStore(self.nodes[target].replicas_of(n))
                for rank in range(index * self.per_node, (index + 1) * self.per_node):
                    if ranks is None or rank in ranks:
                        copy_part(src, dst, step, rank)

    def persist(self, step: int, ranks: list[int] | None = None) -> None:
        """The nodes' parts of ``step`` (``ranks``: only those) copied to the shared persistent tier."""
        dst = LocalStore(self.persistent_dir)
        for n, node in enumerate(self.nodes):
            for rank in self.ranks_of(n):
                if ranks is None or rank in ranks:
                    copy_part(LocalStore(node.ckpt), dst, step, rank)

    # ------------------------------------------------------------ the round

    def _holder_store(self, me: int, holder: int) -> PartStore:
        """``holder``'s copy of ``me``'s parts (``me``: the owner), reads recorded, faults as set."""
        inner = LocalStore(self.nodes[holder].replicas_of(me))
        return HolderStore(inner, holder, me, self.reads, self.faults.get((holder, me), Fault.NONE))

    def group(self, n: int, timeout_s: float = ROUND_TIMEOUT_S, job_end: bool = False) -> NodeGroup:
        """Node ``n`` as its ``rlsup run`` wires it (:meth:`supervisor.cluster.node_run.NodeRun.group`), over the
        shared store, with fresh objects (a node's supervisor after a restart builds them anew); ``timeout_s``: its
        rendezvous_timeout; ``job_end``: it watches for the job's end record (a job that may finish without it)."""
        node = self.nodes[n]
        membership = Membership(self.peers, n)
        coordinator = RoundCoordinator(self.store, JOB, SECRET, n, self.size, timeout_s)
        engine = ReplicationEngine(membership=membership, checkpoint_dir=node.ckpt, replica_root=node.replica_root,
                                   clients={}, state_path=node.root / "state" / "replication.json", job=JOB.id)
        say = node.lines.append
        engine_here = RoundEngine(engine, lambda holder: self._holder_store(n, holder),
                                  lambda holder, owner: self._holder_store(owner, holder))
        return NodeGroup(membership, engine_here,  # type: ignore[arg-type]
                         coordinator, round_role(n, coordinator, node.persistent, say, self.shrink,
                                                 endpoints=lambda: self.peers if self.probe else (),
                                                 store_outlives_node_0=self.etcd_like),
                         FrExchange(coordinator, n, self.size, f"node{n}", Observer()), StopRequest(signal.SIGUSR1),
                         NodeTiers(node.persistent, node.memory), node.ckpt, node.root / "state", say,
                         observer=Observer(),
                         job_end=JobEndWatch.attach(coordinator, node.ckpt, node.persistent, JOB) if job_end else None)

    def round(self, deadline_s: float = ROUND_TIMEOUT_S + 5, nodes: list[int] | None = None) -> list[NodeOutcome]:
        """Every node (``nodes``: those only, the others lost) joins and agrees, each on its own thread (as each
        node's run loop does in ``prepare``). ``self.groups``: each node's group, kept for its next round (as its
        supervisor keeps it across attempts) unless dropped (a restarted node: ``self.groups.pop(n)``)."""
        taking = list(range(self.size)) if nodes is None else nodes
        for n in taking:
            if n not in self.groups:
                self.groups[n] = self.group(n)
        groups = self.groups
        joined: dict[int, int] = {}

        def one(n: int) -> ResumePoint | None:
            joined[n] = groups[n].join(0)
            return groups[n].agree(joined[n], lambda: None)

        results = [in_thread(lambda n=n: one(n), deadline_s) for n in taking]
        outcomes = []
        for n, result in zip(taking, results):
            got = result()
            error = got if isinstance(got, BaseException) else None
            resume = got if isinstance(got, ResumePoint) else None
            outcomes.append(NodeOutcome(n, joined.get(n), resume, error, tuple(self.nodes[n].lines)))
        return outcomes

    def plans(self, attempt: int) -> list[RoundPlan]:
        """Every plan node 0 published for ``attempt``, in order of tries (what every node read)."""
        keys = RoundCoordinator(self.store, JOB, SECRET, 0, self.size, ROUND_TIMEOUT_S).keys
        out = []
        while (value := keys.get(f"plan/{attempt}" + (f"/{len(out)}" if out else ""))) is not None:
            out.append(RoundPlan.from_json(value.payload, 0))
        return out


def step_files(step_dir: Path) -> dict[str, bytes]:
    """Every file of a step directory but the reserved dot-names (holds, temp files, placement records)."""
    if not step_dir.is_dir():
        return {}
    return {p.name: p.read_bytes() for p in sorted(step_dir.iterdir()) if p.is_file() and not p.name.startswith(".")}


def node_step_files(node: SimNode, step: int) -> dict[str, bytes]:
    return step_files(node.ckpt / step_dir_name(step))


__all__ = ["JOB", "Fault", "HolderStore", "NodeOutcome", "Read", "RoundEngine", "SimCluster", "SimNode",
           "node_step_files", "step_files"]
