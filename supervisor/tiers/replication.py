"""Copy this node's valid checkpoint parts to peer nodes, and bring missing parts back.

Triggers: the watchdog library reports new manifests in the checkpoint directory (a part becomes valid
exactly when its manifest appears, since trainer_hooks writes it last); a periodic rescan
(``scan_interval``) catches what an event missed. Each part goes to ``replication_factor`` nodes chosen
by :func:`replica_targets`, through :func:`supervisor.tiers.part_protocol.copy_part` from the checkpoint
directory (:class:`~supervisor.tiers.part_stores.local.LocalStore`) to the peer's replica namespace
(:class:`~supervisor.tiers.part_stores.peer.PeerStore`): verified, files first, manifest last, so a replica
becomes valid only when whole. With several targets lacking a part, it travels as a pipeline
(:class:`~supervisor.tiers.part_stores.peer.ChainStore`): sent once, to the first, which streams it on to
the next as it receives it, and so on; a target the chain did not reach gets a direct copy in the
same pass. The sender never hashes a part before sending it (every receiver checks every byte as it
arrives); a part a receiver refuses as not matching its manifest is reported invalid and not offered
again by this process. While a part is copied its step carries a ``.hold-replication-node<N>-...``
marker, so retention does not delete it mid-copy; once the owner deletes a step (retention), its
replicas are deleted too. Placement is recorded beside each step in
:func:`rlsup_format.names.placement_name` (``.rlsup-placement.node<N>.json``).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable


from rlsup_format.fileio import write_durable
from rlsup_format.manifest import MANIFEST_RE, KnownDigests, RankManifest, list_step_dirs, manifest_name, step_dir_name
from rlsup_format.names import Kind, placement_name, reserved_name
from supervisor.tiers.holdings import InventoryBuilder, NodeInventory, resize_of
from supervisor.tiers.manifest_watch import ManifestWatch
from supervisor.job_identity import namespace_of, parse_namespace
from supervisor.membership import Membership, replica_targets
from supervisor.observer import Observer
from supervisor.tiers.part_protocol import PartInvalid, copy_part
from supervisor.tiers.part_stores.local import LocalStore
from supervisor.tiers.part_stores.peer import ChainStore, PeerStore
from supervisor.tiers.parts import Part, scan_parts, verify_part

if TYPE_CHECKING:
    from supervisor.config import SupervisorConfig

log = logging.getLogger("rlsup.replication")

#: How long a pass waits for the targets' indexes before it chains the targets that answered (the
#: others are served in their own threads as their answers come: a dead peer delays no one).
INDEX_WAIT_S = 5.0
DRAIN_POLL_S = 0.1  # how often a drain looks whether rlsup was asked to stop


@dataclass
class PeerProgress:
    """Replication progress to one peer, for ``rlsup status`` and metrics."""

    bytes_sent: int = 0
    parts_sent: int = 0
    failures: int = 0
    last_error: str = ""
    last_ok: float = 0.0
    lag_s: float = 0.0
    rate_bps: float = 0.0


@dataclass(frozen=True)
class ReplicationSettings:
    """What replication needs from the configuration."""

    factor: int = 1  # copies of each part on other nodes
    jump: int = 1  # ring step between a node and its replica holders
    scan_interval: float = 5.0  # seconds between full rescans (events trigger passes sooner)

    @classmethod
    def from_config(cls, cfg: "SupervisorConfig") -> "ReplicationSettings":
        return cls(cfg.replication_factor, cfg.replication_jump, cfg.replication_scan_interval)


@dataclass(kw_only=True)
class ReplicationEngine:
    """One node's replication: watcher, pusher, inventory and the holders a restore fetches from."""

    membership: Membership
    checkpoint_dir: Path
    replica_root: Path
    clients: dict[int, Any]  # node rank -> PeerClient
    settings: ReplicationSettings = field(default_factory=ReplicationSettings)
    state_path: Path
    observer: Observer = field(default_factory=Observer)
    job: str = "job"  # the job's identity: replicas live in <job>.node<N>, other jobs' parts are never offered
    _wake: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _held: dict[int, set[tuple[int, int]]] = field(default_factory=dict)  # target -> (step, rank) it holds
    # Steps this process saw in the local directory. Only those are mirrored when they disappear: a
    # replacement node with an empty disk must never delete the replicas it is about to restore from.
    _seen_local: set[int] = field(default_factory=set)
    _invalid: set[tuple[int, int, float]] = field(default_factory=set)  # (step, rank, created) refused
    progress: dict[int, PeerProgress] = field(default_factory=dict)
    _threads: list[threading.Thread] = field(default_factory=list)
    _fs: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def me(self) -> int:
        return self.membership.node_rank

    @property
    def targets(self) -> list[int]:
        return replica_targets(self.me, self.membership.size, self.settings.factor, self.settings.jump)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.clean()
        self._fs = ManifestWatch(self.checkpoint_dir, self._wake)
        self._fs.start()
        t = threading.Thread(target=self._loop, name="rlsup-replicator", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._fs is not None:
            self._fs.stop()
        for t in self._threads:
            t.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.settings.scan_interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.sync()
            except Exception as e:  # noqa: BLE001 - never let the replicator thread die
                log.warning("replication pass failed: %s", e)

    # ------------------------------------------------------------ pushing

    def own_parts(self) -> list[Part]:
        """Valid parts in the local directory that this node wrote for this job (sizes checked; checksums
        on push). A part with no job stamp was written outside rlsup into this job's own directory."""
        return [p for p in scan_parts(self.checkpoint_dir, full=False)
                if p.owner in (self.me, None) and job_of(p) in (self.job, None)]

    def sync(self) -> None:
        """One pass: push what each target lacks, delete what the owner no longer keeps.

        What a target holds is read from its index on every pass (not remembered), so a replacement
        node that joined with an empty disk is refilled, and a replica deleted behind our back is re-sent.
        """
        with self._lock:
            parts = [p for p in self.own_parts() if _key(p) not in self._invalid]
            self._seen_local |= {p.step for p in parts}
            targets = self.targets
            with concurrent.futures.ThreadPoolExecutor(max(1, 2 * len(targets)), "rlsup-push") as pool:
                asked = {t: pool.submit(self._index, t) for t in targets}
                concurrent.futures.wait(asked.values(), timeout=INDEX_WAIT_S)
                ready = {t: f.result() for t, f in asked.items() if f.done() and f.result() is not None}
                late = [pool.submit(self._sync_late, t, f, parts) for t, f in asked.items() if not f.done()]
                self._sync_ready(ready, parts)
                concurrent.futures.wait(late)
            self._update_lag(parts)
            self._save_state()

    def _index(self, target: int) -> dict[str, Any] | None:
        if self._stop.is_set():
            return None
        try:
            return self.clients[target].index(namespace_of(self.job, self.me))
        except Exception as e:  # noqa: BLE001 - a dead peer: try again next pass
            self._failed(target, f"index: {e}")
            return None

    def _sync_ready(self, indexes: dict[int, dict[str, Any]], parts: list[Part]) -> None:
        """The targets whose index came in time: each part once down a chain of those that lack it."""
        for target, held in indexes.items():
            self._held[target] = {(p.step, p.rank) for p in parts if _part_held(p, held)}
        for part in parts:
            if self._stop.is_set():
                break
            lacking = [t for t in indexes if (part.step, part.rank) not in self._held[t]]
            direct = self._push_chain(lacking, part) if len(lacking) > 1 else lacking
            for target in direct:
                if not self._stop.is_set() and _key(part) not in self._invalid:
                    self._push(target, part)
        for target, held in indexes.items():
            self._mirror_deletes(target, held, parts)

    def _sync_late(self, target: int, asked: concurrent.futures.Future, parts: list[Part]) -> None:
        """A target whose index came late (or never): direct copies, as its own thread."""
        held = asked.result()
        if held is None or self._stop.is_set():
            return
        self._held[target] = {(p.step, p.rank) for p in parts if _part_held(p, held)}
        for part in parts:
            if (part.step, part.rank) not in self._held[target] and not self._stop.is_set():
                self._push(target, part)
        self._mirror_deletes(target, held, parts)

    def _mirror_deletes(self, target: int, held: dict[str, Any], parts: list[Part]) -> None:
        local_steps = {p.step for p in parts}
        held_steps = {int(k.split("/", 1)[0][5:]) for k in held if k.startswith("step_") and "/" in k}
        for step in sorted((held_steps & self._seen_local) - local_steps):
            if not (self.checkpoint_dir / step_dir_name(step)).exists():
                self._delete(target, step)

    def drain(self, timeout: float, stopped: Callable[[], bool] = lambda: False) -> None:
        """A last pass before the process exits, so the newest checkpoint is not left unreplicated; no longer
        than ``timeout``, and not once ``stopped()`` (a signal during the drain: the scheduler's kill is next)."""
        t = threading.Thread(target=self.sync, daemon=True)
        t.start()
        deadline = time.monotonic() + timeout
        while t.is_alive() and not stopped() and (left := deadline - time.monotonic()) > 0:
            t.join(min(left, DRAIN_POLL_S))

    def local_store(self) -> LocalStore:
        """This node's checkpoint directory as a part store (holds named for this node's replication)."""
        return LocalStore(self.checkpoint_dir, hold_label=f"replication-node{self.me}")

    def move_peer(self, node: int, endpoint: str) -> bool:
        """Node ``node`` now answers at ``endpoint`` (a spare took its rank); True when that is news."""
        if node == self.me or self.membership.peers[node] == endpoint:
            return False
        peers = list(self.membership.peers)
        peers[node] = endpoint
        self.membership = Membership(tuple(peers), self.membership.node_rank)
        self._held.pop(node, None)  # the node there now holds nothing of ours
        old = self.clients.get(node)
        if old is not None:
            self.clients[node] = old.moved(endpoint)
            old.close()
        return True

    def peer_store(self, node: int) -> PeerStore:
        """``node``'s copy of this node's parts (its replica namespace for this job)."""
        return PeerStore(self.clients[node], namespace_of(self.job, self.me), self.state_path.parent, f"node {node}")

    def replicated(self, step: int) -> bool:
        """Whether every part of ``step`` in this node's checkpoint directory is on one of its replica targets (as
        this engine's pushes last saw them): a smaller world grows back at such a step, whose parts a returning node
        can fetch."""
        ranks = [int(m.group(1)) for p in (self.checkpoint_dir / step_dir_name(step)).glob("manifest.rank_*.json")
                 if (m := MANIFEST_RE.match(p.name))]
        try:
            held = set().union(*list(self._held.values()))
        except RuntimeError:  # the pusher changed a set meanwhile: ask again at the next look
            return False
        return bool(ranks) and all((step, r) in held for r in ranks)

    def holder_store(self, holder: int, owner: int) -> LocalStore | PeerStore:
        """``holder``'s copy of ``owner``'s parts: a replica this node keeps (``holder`` is this node), or a peer's
        replica namespace. For a smaller world, where a node also needs parts its own ranks did not write."""
        if holder == self.me:
            return LocalStore(self.replica_root / namespace_of(self.job, owner), hold_label=f"resize-node{self.me}")
        return PeerStore(self.clients[holder], namespace_of(self.job, owner), self.state_path.parent, f"node {holder}")

    def accept(self, manifest: RankManifest) -> str:
        """"" for a part of this job (or one written without rlsup), else why it must not be used."""
        job = manifest.extra.get("job")
        return "" if job in (self.job, None) else f"belongs to job {job!r}, not {self.job!r}"

    def _push(self, target: int, part: Part) -> None:
        started = time.monotonic()
        try:
            done = copy_part(self.local_store(), self.peer_store(target), part.step, part.rank, full=False,
                             keep_valid=False)
        except PartInvalid as e:
            self._refused(part, [target], e)
            return
        except Exception as e:  # noqa: BLE001 - a dead or lying peer, or a part changed under us: only this copy fails
            self._failed(target, f"step {part.step} rank {part.rank}: {e}")
            return
        self._copied([target], part, done.written, done.size, time.monotonic() - started)

    def _push_chain(self, targets: list[int], part: Part) -> list[int]:
        """Copy ``part`` once down the chain ``targets`` (in order); returns the targets it did not
        reach, for a direct copy."""
        ends = {self.membership.peers[t]: t for t in targets}
        chain = ChainStore([(self.peer_store(t), ep) for ep, t in ends.items()])
        started = time.monotonic()
        try:
            done = copy_part(self.local_store(), chain, part.step, part.rank, full=False, keep_valid=False)
        except PartInvalid as e:
            self._refused(part, targets, e)
            return []
        except Exception as e:  # noqa: BLE001 - the first peer failed (or the copy did not verify): copy one by one
            log.info("step %s rank %s: chain %s failed (%s); copying to each directly",
                     part.step, part.rank, chain.location, e)
            self._failed(targets[0], f"step {part.step} rank {part.rank}: {e}")
            return targets[1:]
        reached = [ends[ep] for ep in chain.reached]
        self._copied(reached, part, done.written, done.size, time.monotonic() - started)
        for ep, why in chain.failed.items():
            log.info("step %s rank %s: chain did not reach node %s (%s); copying directly",
                     part.step, part.rank, ends[ep], why)
        return [t for t in targets if t not in reached]

    def _copied(self, targets: list[int], part: Part, written: bool, size: int, elapsed: float) -> None:
        for target in targets:
            prog = self.progress.setdefault(target, PeerProgress())
            self._held.setdefault(target, set()).add((part.step, part.rank))
            if written:
                self.observer.replicated(str(target), size)
                prog.bytes_sent += size
                prog.parts_sent += 1
                prog.rate_bps = size / elapsed if elapsed > 0 else 0.0
            prog.last_ok = time.time()
        self._record_placement(part)

    def _refused(self, part: Part, targets: list[int], e: Exception) -> None:
        """The part is not what its manifest says: reported to every target, not offered again."""
        self._invalid.add(_key(part))
        for target in targets:
            self._failed(target, f"step {part.step} rank {part.rank} is invalid here, not replicated: {e}")

    def _failed(self, target: int, error: str) -> None:
        prog = self.progress.setdefault(target, PeerProgress())
        prog.failures += 1
        prog.last_error = error
        self.observer.replication_failed(str(target))
        log.warning("replication to node %s failed: %s", target, error)

    def _delete(self, target: int, step: int) -> None:
        """Retention mirrored: the owner deleted ``step`` (seen here, then gone), so its replicas go too."""
        try:
            self.peer_store(target).delete(step)
        except Exception as e:  # noqa: BLE001 - a peer that cannot delete keeps a stale replica; retention there retries
            log.warning("deleting replica of step %s on node %s failed: %s", step, target, e)

    def _record_placement(self, part: Part) -> None:
        path = part.step_dir / placement_name(self.me)
        placed = sorted(t for t in self.targets if (part.step, part.rank) in self._held.get(t, set()))
        data = {"step": part.step, "owner": self.me, "targets": placed,
                "peers": [self.membership.peers[t] for t in placed], "updated": time.time()}
        try:
            write_durable(path, json.dumps(data).encode(), part.step_dir / reserved_name(Kind.TMP, "placement"))
        except OSError:
            pass  # the step was deleted meanwhile: nothing to record

    def _update_lag(self, parts: list[Part]) -> None:
        for target in self.targets:
            missing = [p for p in parts if (p.step, p.rank) not in self._held.get(target, set())]
            lag = time.time() - min(p.manifest.created for p in missing) if missing else 0.0
            self.progress.setdefault(target, PeerProgress()).lag_s = lag
            self.observer.replication_lag(str(target), lag)

    def _save_state(self) -> None:
        data = {
            "node": self.me,
            "peers": list(self.membership.peers),
            "targets": self.targets,
            "progress": {str(t): vars(p) for t, p in self.progress.items()},
            "steps": {str(t): sorted({step for step, _ in held}) for t, held in self._held.items()},
            "updated": time.time(),
        }
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_name(reserved_name(Kind.TMP, self.state_path.name))
        write_durable(self.state_path, json.dumps(data, indent=1).encode(), tmp)

    # ------------------------------------------------------------ restore

    def inventory(self, known: KnownDigests | None = None) -> NodeInventory:
        """What this node holds, fully verified (a corrupted copy is never offered); ``known``: checksums this
        restart already computed, reused for files unchanged since (:class:`rlsup_format.manifest.KnownDigests`)."""
        held = InventoryBuilder(self.me)
        for part in scan_parts(self.checkpoint_dir, full=True, known=known):
            if job_of(part) not in (self.job, None):
                continue  # another job wrote into this directory: never offered to this one
            held.add(part.step, part.world_size, part.rank, part.owner if part.owner is not None else self.me,
                     resize=resize_of(part.manifest))
        if self.replica_root.is_dir():
            for ns_dir in sorted(self.replica_root.iterdir()):
                parsed = parse_namespace(ns_dir.name)
                if parsed is None or parsed[0] != self.job:
                    continue  # another job's replicas (or an older layout): never this job's data
                owner = parsed[1]
                for part in scan_parts(ns_dir, full=True, known=known):
                    if job_of(part) == self.job:
                        held.add(part.step, part.world_size, part.rank, owner, replica=True,
                                 resize=resize_of(part.manifest))
        return held.build()

    def clean(self) -> None:
        """Leftovers of killed fetches and copies: temp files in the checkpoint directory's steps, stale
        holds, spooled transfers in the state directory (one rule: rlsup_format.leftovers)."""
        self.local_store().clean()
        if self.clients:
            self.peer_store(next(iter(self.clients))).clean()


def _key(part: Part) -> tuple[int, int, float]:
    """A part as written once: a rewritten part (new manifest) is a new key."""
    return part.step, part.rank, part.manifest.created


def job_of(part: Part) -> str | None:
    """The job a part's manifest names (None: written without rlsup)."""
    job = part.manifest.extra.get("job")
    return job if isinstance(job, str) else None


def _part_held(part: Part, index: dict[str, Any]) -> bool:
    """The target's index lists every file of ``part`` and its manifest with matching checksums."""
    base = step_dir_name(part.step)
    if f"{base}/{manifest_name(part.rank)}" not in index:
        return False
    return all(index.get(f"{base}/{name}") == entry for name, entry in part.manifest.files.items())


def newest_own_step(checkpoint_dir: Path, node: int, full: bool = False, known: KnownDigests | None = None) -> int | None:
    """Newest step holding a valid part written by ``node`` (sizes only unless ``full``; ``known``: as for
    :meth:`ReplicationEngine.inventory`)."""
    for step, step_dir in reversed(list_step_dirs(checkpoint_dir)):
        for entry in step_dir.iterdir():
            m = MANIFEST_RE.match(entry.name)
            part = verify_part(step_dir, int(m.group(1)), full=full, known=known) if m else None
            if part is not None and part.owner in (node, None):
                return step
    return None
