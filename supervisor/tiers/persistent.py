"""The persistent checkpoint tier's policy: which parts of which steps go to a shared filesystem or an
object store (``persistent_dir``), when, how long they stay, and what is offered back.

Node-local disks and peer replicas die with the allocation; a copy on a shared filesystem (Lustre,
GPFS, NFS) or an object store (any fsspec URL: ``s3://``, ``gs://`` ...) outlives it. How a part is
copied (verified source, data first, manifest last) is :func:`supervisor.tiers.part_protocol.copy_part`;
where it lives is a :class:`~supervisor.tiers.part_protocol.PartStore`. This module only decides:

* **One mode for one node and many.** Every node copies the parts its own ranks wrote (the manifest's
  ``node_rank``; a single node is node 0 and owns every part). Node 0 *starts* a step: its newest
  step whose local parts are all valid, when the cadence says so (``every_n`` steps or
  ``every_seconds`` since the last start, either one; every new step when neither is set). Every node
  *joins* the started steps not older than the newest complete one. No other node decides alone, so
  nodes with different clocks or restart histories complete the same steps. The node is fixed at
  construction (:meth:`PersistentSettings.from_config`).
* **Retention** (``keep_last``, node 0 only): :func:`rlsup_format.retention.steps_to_delete` over the
  tier's steps (valid = every manifest there and every file of the right size); a step a restore is
  using is protected (:meth:`PersistentTier.protect`).
* **Exit**: :meth:`PersistentTier.flush` copies the newest step whatever the cadence.
* **Restore**: :meth:`PersistentTier.latest_valid` (every checksum), :meth:`PersistentTier.fetch`
  (a whole step, for one node) and :meth:`PersistentTier.part_listing` (parts, for the multi-node
  planner, whose nodes then fetch a part with :func:`supervisor.tiers.part_protocol.fetch_part`, the
  tier's :attr:`PersistentTier.store` one of its holders).

The background thread (:meth:`PersistentTier.start`) wakes when a manifest appears in the local
checkpoint directory (:mod:`supervisor.tiers.manifest_watch`), and otherwise every
``PersistentSettings.wake_interval`` seconds: ``IDLE_WAKE_S`` (5 s) by default, since a pass lists the
tier (an object store bills listings) and new parts already wake it; a tenth of ``every_seconds``
(at most 5 s) when only a time cadence is set, so that a copy starts within a tenth of its period. A half-finished copy (rlsup killed mid-copy) is a step directory in the
tier whose part lacks its manifest: never valid, never offered, completed by the next pass that
joins the step, or removed by retention once older than the newest valid step; its temp files go
through :func:`rlsup_format.leftovers.clean_leftovers`. ``bandwidth`` (bytes/s, 0 = unlimited) caps
the tier's reads and writes together (:class:`supervisor.transport.client.BandwidthLimiter`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from rlsup_format.manifest import ManifestError, RankManifest, list_step_dirs, verify_step
from rlsup_format.names import manifest_name, parse_manifest_rank, step_dir_name
from rlsup_format.retention import StepState, steps_to_delete
from supervisor.bounded_calls import BoundedCalls, forked_child
from supervisor.tiers.holdings import TierOffer
from supervisor.tiers import fetch_staging, private_files
from supervisor.tiers.fetch_staging import FetchTicket, staging_dir
from supervisor.tiers.poll_loop import STALL_S, PollLoop
from supervisor.tiers.part_protocol import PartError, PartInvalid, PartStore, copy_part
from supervisor.tiers.part_stores import open_store
from supervisor.tiers.part_stores.local import LocalStore
from supervisor.tiers.parts import Part, owner_of, verify_part

if TYPE_CHECKING:
    from supervisor.config import SupervisorConfig

log = logging.getLogger(__name__)
#: The background pass when nothing wakes it (see the module docstring).
IDLE_WAKE_S = 5.0

CLEAN_EVERY_S = 60.0  # leftovers of killed copies: a walk of every step directory, not every pass
HOLD_LABEL = "persistent"  # hold markers in the checkpoint dir while a part is copied: .hold-persistent-...


class PersistentTierError(RuntimeError):
    """A copy to or from the persistent tier failed or did not verify."""




@dataclass(frozen=True)
class TierCopy:
    """A step that verified in the persistent tier."""

    step: int
    location: str
    size_bytes: int


@dataclass(frozen=True)
class PersistentSettings:
    """What the tier needs from the configuration (0 means "off" for every optional number)."""

    location: str
    every_n: int | None = None
    every_seconds: float | None = None
    keep_last: int | None = None
    bandwidth: float = 0.0
    source: Path | None = None  # the checkpoint directory parts are copied from
    node: int = 0  # this node's rank; a single node is node 0

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError("persistent keep_last must be >= 1 (or None/0 to keep everything)")

    @classmethod
    def make(cls, location: str | os.PathLike, *, every_n: int | None = None, every_seconds: float | None = None,
             keep_last: int | None = None, bandwidth: float = 0.0, source: str | os.PathLike | None = None,
             node: int = 0) -> "PersistentSettings":
        return cls(str(location), every_n or None, every_seconds or None, keep_last or None, float(bandwidth or 0),
                   Path(source) if source is not None else None, node)

    @classmethod
    def from_config(cls, cfg: "SupervisorConfig", node: int = 0, job: str = "") -> "PersistentSettings | None":
        """None when ``persistent_dir`` is empty. ``job``: the job's identity; its copies live under
        ``<persistent_dir>/<job>/``, so jobs that share a persistent_dir never see each other's steps."""
        if not cfg.persistent_dir:
            return None
        target = cfg.persistent_dir.rstrip("/") + "/" + job if job else cfg.persistent_dir
        return cls.make(target, every_n=cfg.persistent_every, every_seconds=cfg.persistent_every_seconds,
                        keep_last=cfg.persistent_keep_last, bandwidth=cfg.persistent_bandwidth,
                        source=cfg.checkpoint_dir, node=node)

    @property
    def wake_interval(self) -> float:
        """Seconds between the background thread's passes (see the module docstring)."""
        if self.every_seconds is not None and self.every_n is None:
            return max(0.05, min(IDLE_WAKE_S, self.every_seconds / 10))
        return IDLE_WAKE_S


#: What a pass of :meth:`PersistentTier.poll` changes: copied back from the child a forked pass ran in.
#: What the parent changes meanwhile is never among them (:meth:`PersistentTier.protect`).
_PASS_STATE = ("_done", "_last_step", "_last_time", "_retain_due", "_retained", "_retained_protect", "_last_clean",
               "copies", "bytes_copied", "last_error", "moved", "_final")
#: How long :meth:`PersistentTier.protect` waits for a pass in progress (whose retention read the old step).
PROTECT_WAIT_S = STALL_S


class PersistentTier:
    """Copies this node's valid parts to the tier and offers them back; see the module docstring.

    ``PersistentTier(location, every_n=..., keep_last=..., source=..., node=...)`` or
    :meth:`from_config`."""

    def __init__(self, location: str | os.PathLike | PersistentSettings, *,
                 clock: Callable[[], float] = time.monotonic, **options: Any) -> None:
        s = location if isinstance(location, PersistentSettings) else PersistentSettings.make(location, **options)
        self.settings = s
        self.limiter = _limiter(s.bandwidth)
        self.moved = 0  # bytes read or written by the tier's copies so far: a bounded read's sign of progress
        self.store: Any = open_store(s.location, self.throttle)
        self.location = self.store.location
        self.node = s.node
        self._leads = s.node == 0  # starts and prunes steps: node 0, or the node that leads the job's round for it
        self.source = s.source
        self._clock = clock
        self._last_step: int | None = None  # the step node 0 last started (the cadence counts from it)
        self._last_time: float | None = None
        self._done: set[tuple[int, int, float]] = set()  # (step, rank, manifest created) known in the tier
        self._protected: set[int] = set()  # steps a restore is using: retention leaves them alone
        self._protect_changes = 0  # protect() calls; a pass whose retention has not seen the last one retains
        self._retained_protect = 0  # ... the count the last retention saw
        self._last_clean: float | None = None
        self._retain_due = True  # retention runs after a write, a change of steps or of the protected step
        self._retained: tuple[list[int], int | None] = ([], None)  # (steps, newest complete) it last saw
        self._final = False  # flush(): the last copy ignores the cadence
        self._lock = threading.Lock()
        # A tier on a mounted filesystem is read and written only from threads whose descriptor table is their
        # own: a fork of rlsup's never inherits (and closes at exec) a file open on a mount that may hang.
        shared_fs = isinstance(self.store, LocalStore)
        enter = private_files.enter if shared_fs else None
        self._files: Callable[[Callable[[], Any]], Any] = private_files.run if shared_fs else _call
        # On a mount, each pass runs in a forked child (a copy stuck in a hung mount never holds rlsup's exit);
        # _PASS_STATE is what a pass changes. Not for an object store: its client's threads are not in a child.
        # The parent holds _lock across a forked pass (hold=): fetch and protect wait for it, and its copy-back.
        self._loop = PollLoop(self.poll, "rlsup-persistent-tier", self._pass_failed, on_stall=self._stalled,
                              on_thread_start=enter, owner=self, keep=_PASS_STATE if shared_fs else None,
                              hold=self._lock if shared_fs else None)
        #: The run loop's reads of the tier (a restart's resume choice): never past STALL_S without progress.
        self.reads = BoundedCalls(f"reading the persistent tier {self.location} for the resume", STALL_S, enter)
        self.copies = 0
        self.bytes_copied = 0
        self.last_error: str | None = None

    @classmethod
    def from_config(cls, cfg: "SupervisorConfig", node: int = 0, job: str = "") -> "PersistentTier | None":
        """The tier of a SupervisorConfig (``persistent_*`` keys); None when ``persistent_dir`` is empty."""
        settings = PersistentSettings.from_config(cfg, node, job)
        return cls(settings) if settings is not None else None

    # ---------------------------------------------------------------- copying out

    def _due(self, step: int) -> bool:
        s = self.settings
        if self._final or (s.every_n is None and s.every_seconds is None) or self._last_step is None:
            return True
        by_steps = s.every_n is not None and step - self._last_step >= s.every_n
        by_time = s.every_seconds is not None and (
            self._last_time is None or self._clock() - self._last_time >= s.every_seconds)
        return by_steps or by_time

    def poll(self, source: str | os.PathLike | None = None) -> int | None:
        """One pass: start a step (node 0, when due), copy this node's parts of the started steps,
        prune (node 0). Returns the newest step this pass wrote a part of, or None."""
        root = Path(source) if source is not None else self.source
        if root is None:
            raise ValueError("no source checkpoint directory: pass source= to PersistentTier or poll()")
        local = LocalStore(root, hold_label=HOLD_LABEL)
        self._loop.doing = f"listing {self.location}"
        # a forked pass: its parent holds _lock for it (this copy of the lock may have been taken at the fork)
        with contextlib.nullcontext() if forked_child() else self._lock:
            self._maybe_clean(local)
            steps = self.store.steps()
            if self._last_step is None and steps:
                self._last_step = steps[-1]  # a restarted node 0 continues the cadence, not restarts it
            floor = self._newest_complete(steps)
            own = self._own_local_parts(root, floor)
            wanted = {s for s in steps if s in own and (floor is None or s >= floor)}
            started = self._step_to_start(own, steps)
            if started is not None:
                wanted.add(started)
            copied = None
            for step in sorted(wanted, reverse=True):
                for part in own[step]:
                    if self._copy_out(local, part) and copied is None:
                        copied = step
            if started is not None and all(self._is_done(p) for p in own[started]):
                self._last_step, self._last_time = started, self._clock()
            if self._leads and (copied is not None or self._retain_due or (steps, floor) != self._retained
                                   or self._retained_protect != self._protect_changes):
                self._retain()
                self._retained = (self.store.steps(), floor)
            return copied

    def _step_to_start(self, own: dict[int, list[Part]], steps: list[int]) -> int | None:
        """Node 0: its newest step whose local parts all verify (sizes) and that the tier lacks, newer
        than the last step started, if the cadence says it is due."""
        if not self._leads:
            return None
        for step in sorted(own, reverse=True):
            if step in steps or (self._last_step is not None and step <= self._last_step):
                return None
            step_dir = own[step][0].step_dir
            try:
                ranks = [r for n in os.listdir(step_dir) if (r := parse_manifest_rank(n)) is not None]
            except OSError:
                continue
            if all(verify_part(step_dir, r, full=False) is not None for r in ranks):
                return step if self._due(step) else None
            # a torn part: this step is not whole here (and never will be as it is); try an older one
        return None

    def _copy_out(self, local: LocalStore, part: Part) -> bool:
        """Copy one own part into the tier; True when bytes were written."""
        if self._is_done(part):
            return False
        t0 = time.monotonic()
        self._loop.doing = f"copying step {part.step} rank {part.rank} to {self.location}"
        try:
            done = copy_part(local, self.store, part.step, part.rank)
        except PartInvalid as e:  # changed or deleted locally since the scan: never persist a bad part
            log.info("persistent copy of step %d rank %d skipped: %s", part.step, part.rank, e)
            return False
        except (OSError, ManifestError, PartError) as e:
            self.last_error = f"step {part.step} rank {part.rank}: {e}"
            log.warning("persistent copy of step %d rank %d to %s failed: %s", part.step, part.rank, self.location, e)
            return False
        self._done.add((part.step, part.rank, part.manifest.created))  # this local part is in the tier (or a valid one is)
        self.last_error = None
        if not done.written:
            return False
        self.copies += 1
        self.bytes_copied += done.size
        log.info("step %d rank %d copied to the persistent tier %s in %.1fs", part.step, part.rank, self.location,
                 time.monotonic() - t0)
        return True

    def _is_done(self, part: Part) -> bool:
        return (part.step, part.rank, part.manifest.created) in self._done

    def _maybe_clean(self, local: LocalStore) -> None:
        """Leftovers of killed copies (temp files, stale holds, half-deleted steps), at most every
        CLEAN_EVERY_S: in the tier and in the checkpoint directory the parts are copied from."""
        now = time.monotonic()
        if self._last_clean is None or now - self._last_clean >= CLEAN_EVERY_S:
            self._last_clean = now
            self.store.clean()
            local.clean()

    def _manifest_ranks(self, step: int) -> set[int]:
        try:
            names = self.store.reader(step).names()
        except (FileNotFoundError, NotADirectoryError):
            return set()
        return {r for n in names if (r := parse_manifest_rank(n)) is not None}

    def _newest_complete(self, steps: list[int]) -> int | None:
        """Newest step whose manifests of ranks 0..W-1 are all present (names only: cheap)."""
        for step in reversed(steps):
            ranks = self._manifest_ranks(step)
            if not ranks:
                continue
            try:
                raw = self.store.reader(step).read(manifest_name(min(ranks)))
                world = RankManifest.from_json(raw).world_size
            except (OSError, ManifestError):
                continue
            if ranks == set(range(world)):
                return step
        return None

    def _own_local_parts(self, root: Path, min_step: int | None) -> dict[int, list[Part]]:
        """This node's valid parts (sizes checked) in its checkpoint directory, by step, from ``min_step``."""
        out: dict[int, list[Part]] = {}
        for step, step_dir in list_step_dirs(root):
            if min_step is not None and step < min_step:
                continue
            try:
                names = sorted(os.listdir(step_dir))
            except OSError:
                continue
            for name in names:
                rank = parse_manifest_rank(name)
                part = verify_part(step_dir, rank, full=False) if rank is not None else None
                if part is not None and part.step == step and part.owner in (self.node, None):
                    out.setdefault(step, []).append(part)
        return out

    def _retain(self) -> None:
        """Node 0: :func:`rlsup_format.retention.steps_to_delete` over the tier (sizes checked). Run
        after a pass that wrote, when the tier's steps or its newest complete step changed, or when the
        protected step changed: not on every quiet pass (an object store charges each listing)."""
        self._retain_due, self._retained_protect = False, self._protect_changes
        if self.settings.keep_last is None:
            return
        protected = set(self._protected)
        states = [StepState(s, self.verify(s, full=False), s in protected) for s in self.store.steps()]
        for step in steps_to_delete(states, self.settings.keep_last):
            log.info("persistent tier retention removes step %d", step)
            self.store.delete(step)
            self._done = {d for d in self._done if d[0] != step}

    def lead(self, leads: bool) -> None:
        """Whether this node starts and prunes the tier's steps from now on: the node that leads the job's rounds
        (node 0, or the node that took its place after its loss: :mod:`supervisor.cluster.round_lead`)."""
        self._leads = leads

    def protect(self, step: int | None) -> None:
        """Keep ``step`` from retention (the step a restore is using); replaces the previous one. Waits (at most
        :data:`PROTECT_WAIT_S`: a pass stuck in a hung mount is not waited for) for a pass in progress, whose
        retention read the protected step before this call: once this returns, no pass removes ``step``. Never
        a pass's state: a pass's copy-back does not undo it."""
        held = self._lock.acquire(timeout=PROTECT_WAIT_S)
        try:
            self._protected = set() if step is None else {step}
            self._protect_changes += 1
        finally:
            if held:
                self._lock.release()

    # ---------------------------------------------------------------- background thread

    def start(self, source: str | os.PathLike | None = None, interval: float | None = None) -> None:
        """Poll in a daemon thread until :meth:`stop`, every ``interval`` seconds (default:
        ``settings.wake_interval``, see the module docstring)."""
        if source is not None:
            self.source = Path(source)
        # A new part is persisted as soon as its manifest appears.
        self._loop.start(interval if interval is not None else self.settings.wake_interval, watch=self.source)

    def _pass_failed(self, e: Exception) -> None:
        self.last_error = str(e)

    def throttle(self, n: int) -> None:
        """Called before each chunk the tier's copies move: counts it, and waits under ``bandwidth``."""
        self.moved += n
        if self.limiter is not None:
            self.limiter.consume(n)

    def stalled(self) -> str | None:
        """Why the tier is not answering (its pass in progress was named stalled, or a read of the run loop's
        outlived its deadline and has not returned yet), or None."""
        if self._loop.stuck():
            return self._loop.stalled
        if self.reads.blocked_since is not None:
            return (f"{self.reads.what} has not answered for {time.monotonic() - self.reads.blocked_since:.0f}s: "
                    "the store is slow or not answering")
        return None

    def _stalled(self, line: str) -> None:
        self.last_error = f"{self.location}: {line}"

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop the thread after its current copy (a copy in progress is finished, not torn)."""
        self._loop.stop(timeout)

    def flush(self, timeout: float) -> int | None:
        """The job ended (finished, stopped, preempted): stop the thread, then copy the newest valid step
        whatever the cadence says, so the run's last checkpoint outlives the allocation. Waits at most
        ``timeout`` seconds; a copy cut off by rlsup's exit lacks its manifest (never valid) and is
        completed or removed by a later pass. On several nodes node 0 starts the step and the others
        join only if they see it started, so there the final copy is best effort."""
        self.stop(timeout)
        if self._loop.stuck():  # a hung store: another pass would only hang beside the first
            log.warning("final persistent copy skipped: %s", self._loop.stalled)
            return None
        self._final = True
        result: list[int | None] = []

        def final() -> None:
            try:
                # a forked pass (a tier on a mount) is a process of its own: no private table needed in it
                result.append(self._loop.call(self.poll if self._loop.keep is not None else  # type: ignore[arg-type]
                                              lambda: self._files(self.poll)))
            except Exception as e:  # noqa: BLE001 - the tier must never kill the supervisor
                self.last_error = str(e)
                log.warning("final persistent copy failed: %s", e)

        thread = threading.Thread(target=final, name="rlsup-persistent-flush", daemon=True)
        thread.start()
        thread.join(timeout)
        return result[0] if result else None

    # ---------------------------------------------------------------- reading back

    def steps(self) -> list[int]:
        """Steps present in the tier (valid or not), oldest first."""
        return self.store.steps()

    def verify(self, step: int, full: bool = True) -> bool:
        return self._files(lambda: self._verify(step, full))

    def _verify(self, step: int, full: bool) -> bool:
        return verify_step(self.store.reader(step), step, full, str(self.store.path(step))).valid

    def latest_valid(self) -> TierCopy | None:
        """The newest step whose copy verifies in full (every checksum), or None."""
        return self._files(self._latest_valid)

    def _latest_valid(self) -> TierCopy | None:
        for step in reversed(self.store.steps()):
            r = verify_step(self.store.reader(step), step, True, str(self.store.path(step)))
            if r.valid:
                return TierCopy(step, str(self.store.path(step)), r.size_bytes)
        return None

    def fetch(self, step: int, dest_dir: str | os.PathLike, ticket: FetchTicket | None = None) -> Path:
        """Copy the whole ``step`` into ``dest_dir/step_N`` part by part (:func:`copy_part`); returns that
        path. The copy is made in a private staging directory and moved into place at the end, only while
        ``ticket`` is not cancelled (:mod:`supervisor.tiers.fetch_staging`); PersistentTierError when it was,
        or when the tier's copy does not verify: then nothing of it is left in ``dest_dir``."""
        return self._files(lambda: self._fetch(step, dest_dir, ticket))

    def _fetch(self, step: int, dest_dir: str | os.PathLike, ticket: FetchTicket | None) -> Path:
        staged = staging_dir(dest_dir)
        local = LocalStore(staged, self.throttle, HOLD_LABEL)
        with self._lock:
            try:
                LocalStore(dest_dir, self.throttle, HOLD_LABEL).clean()  # what a killed fetch left
                fetch_staging.remove_stale(dest_dir)
                check = verify_step(self.store.reader(step), step, False, str(self.store.path(step)))
                if not check.valid:
                    raise PersistentTierError(f"step {step} in {self.location} does not verify: {check.reason}")
                for rank in range(check.world_size or 0):
                    copy_part(self.store, local, step, rank, full=False)
            except (OSError, ManifestError, PartError) as e:
                shutil.rmtree(staged, ignore_errors=True)
                raise PersistentTierError(f"fetching step {step} from {self.location} failed: {e}") from e
            except BaseException:
                shutil.rmtree(staged, ignore_errors=True)
                raise
            dest = Path(dest_dir) / step_dir_name(step)
            if not fetch_staging.place(local.path(step), dest, ticket):
                raise PersistentTierError(f"fetching step {step} from {self.location}: abandoned by the restart")
            return dest

    def part_listing(self, newer_than: int | None = None,
                     exclude: set[tuple[int, int]] | frozenset[tuple[int, int]] = frozenset()) -> dict[int, TierOffer]:
        """Parts offered for a multi-node restore, by step (owners as the manifests record them; ranks
        without one are left out there).

        Cheap: manifests read and file sizes checked, no checksums (the fetching node checks every
        byte). Newest first, down to ``newer_than`` (exclusive) or the first step whose every rank is
        offered, since nothing older could then be chosen. ``exclude``: (step, rank) known bad."""
        return self._files(lambda: self._part_listing(newer_than, exclude))

    def _part_listing(self, newer_than: int | None, exclude: Any) -> dict[int, TierOffer]:
        out: dict[int, TierOffer] = {}
        for step in reversed(self.store.steps()):
            if newer_than is not None and step <= newer_than:
                break
            offered = _offered_parts(self.store, step, exclude)
            worlds = {m.world_size for m in offered.values()}
            if len(worlds) != 1:
                continue
            (world,) = worlds
            owners = {r: o for r, m in offered.items() if (o := owner_of(m)) is not None}
            out[step] = TierOffer(world, frozenset(offered), owners)
            if sorted(offered) == list(range(world)):
                break
        return out


def _offered_parts(store: PartStore, step: int, exclude: Any) -> dict[int, RankManifest]:
    """The parts of ``step`` whose manifest parses and whose files have their sizes, by rank."""
    reader = store.reader(step)
    try:
        names = reader.names()
    except (FileNotFoundError, NotADirectoryError):
        return {}
    out = {}
    for name in names:
        rank = parse_manifest_rank(name)
        if rank is None or (step, rank) in exclude:
            continue
        try:
            m = RankManifest.from_json(reader.read(name))
        except (FileNotFoundError, ManifestError):
            continue
        if (m.rank, m.step) == (rank, step) and all(not reader.check(rel, e, False) for rel, e in m.files.items()):
            out[rank] = m
    return out


def _call(fn: Callable[[], Any]) -> Any:
    return fn()


def _limiter(bandwidth: float) -> Any:
    if not bandwidth:
        return None
    from supervisor.transport.client import BandwidthLimiter

    return BandwidthLimiter(bandwidth)


__all__ = ["PersistentSettings", "PersistentTier", "PersistentTierError", "TierCopy"]
