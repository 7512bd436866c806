"""The memory checkpoint tier: steps saved into node shared memory, drained to ``checkpoint_dir``.

A save into a tmpfs (``/dev/shm``) costs a copy at memory bandwidth instead of a disk write, so a
trainer can save every step or every few, and a crashed rank redoes at most those. rlsup owns the
tier, not the ranks: the job's directory is ``<memory_dir>/rlsup-<job id>`` (:func:`job_memory_dir`;
two jobs never share one, and a SIGKILLed rlsup's successor for the same job finds it again). The
ranks learn it through ``RLSUP_MEMORY_DIR`` and write steps there with the disk protocol
(:mod:`trainer_hooks.memory_tier`), so a step in memory is valid by the same rules.

This module is the supervisor's side:

* **Draining.** A background thread copies the newest valid memory step to ``checkpoint_dir`` once
  ``disk_every`` steps or ``disk_every_seconds`` passed since the last drained one (either; every new
  step when neither is set), part by part through :func:`supervisor.tiers.part_protocol.copy_part` (source
  verified, data first, manifest last) while the step holds a ``.hold-drain-...`` marker, so the
  trainer's retention leaves it alone. From ``checkpoint_dir`` replication and the persistent tier
  take it as before. It wakes when a manifest appears (:mod:`supervisor.tiers.manifest_watch`).
* **Retention on disk** after a drain: the trainer's ``keep_last``, which it records in each memory
  manifest (``extra["disk_keep_last"]``); a trainer that keeps everything gets everything kept. The
  newest valid step, held steps and the step being resumed from stay.
* **Restart selection** reads the tier like any other (:meth:`MemoryTier.newest_valid`, used by
  :func:`supervisor.tiers.selection.choose_across_tiers`): a step resumed from memory is loaded in place.
  At launch the tier's steps newer than the resume step are removed (:meth:`MemoryTier.supersede`):
  another timeline's, which the attempt must neither resume from nor mistake for its own saves.
* **The end** (:meth:`MemoryTier.finish`): the newest valid memory step is drained if disk lacks it;
  after a successful run the job's directory is then removed, after a stop, preemption or give-up it
  is kept. A drain that failed never removes anything.

**On several nodes** (:mod:`supervisor.cluster.multinode`) each node's tier holds only its own ranks' parts
(``<memory_dir>/rlsup-<job>-node<k>``), so "valid" above means "every part of this node's ranks is
valid" (:class:`supervisor.tiers.node_parts.NodeParts`), per part: the drainer copies the node's own parts,
retention and the end count such steps. Two things change with it. The drained steps must be the same
steps on every node, or disk and replicas never hold a whole step: a node drains the first step at or
past each multiple of ``disk_every`` (every step without it; ``disk_every_seconds`` is refused, as
clocks differ). And the trainer's retention of the tier (rank 0, on a whole step) never runs there,
so the drainer applies ``memory_keep_last`` itself. Every valid part in the tier is offered to the
coordinator's plan (:meth:`MemoryTier.inventory`); a step resumed in place needs all the node's parts
there (:meth:`MemoryTier.resume_dir`), else they are copied beside the rest in ``checkpoint_dir``
(:meth:`MemoryTier.copy_to_disk`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rlsup_format import job_env
from rlsup_format.fileio import remove_path
from rlsup_format.leftovers import is_stale
from rlsup_format.manifest import KnownDigests, ManifestError, is_held, list_step_dirs
from rlsup_format.names import Kind, parse_reserved, step_dir_name
from rlsup_format.retention import StepState, steps_to_delete
from supervisor.tiers.holdings import InventoryBuilder, NodeInventory, resize_of
from supervisor.tiers.node_parts import NodeParts
from supervisor.tiers.part_protocol import PartError, copy_part
from supervisor.tiers.part_stores.local import LocalStore
from supervisor.tiers.poll_loop import PollLoop

if TYPE_CHECKING:
    from supervisor.config import SupervisorConfig

log = logging.getLogger(__name__)

ENV_NAMES = (job_env.MEMORY_DIR, job_env.MEMORY_KEEP_LAST, job_env.MEMORY_LIMIT_BYTES)  # what env() sets
HOLD_LABEL = "drain"  # .hold-drain-... in a memory step while it is copied to disk
IDLE_WAKE_S = 5.0  # the drain pass when no manifest wakes it
CLEAN_EVERY_S = 60.0
RAM_FILESYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")


def job_memory_dir(memory_dir: str | os.PathLike, job: str, node: int | None = None) -> Path:
    """The job's own directory in the tier (``job`` is a :class:`~supervisor.job_identity.JobIdentity` id:
    safe as a path component, derived the same way by a successor rlsup of the same job). On several
    nodes each node has its own (``node``), even where two nodes share one host's tmpfs."""
    return Path(memory_dir) / (f"rlsup-{job}" if node is None else f"rlsup-{job}-node{node}")


def filesystem_type(path: Path) -> str:
    """The type of the filesystem ``path`` is on (``/proc/self/mounts``, longest mount point), or ""."""
    best, kind = "", ""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    target = os.path.realpath(path)
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind


def being_written(step_dir: Path) -> bool:
    """True while a live process of this host (or one that cannot be checked, for up to an hour) has a
    staging directory or temp file in ``step_dir``: an invalid step with a writer is a save under way,
    never a torn leftover, whatever steps are newer."""
    try:
        names = os.listdir(step_dir)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot look inside: keeping it is the safe answer
    now = time.time()
    for name in names:
        res = parse_reserved(name)
        if res is None or res.kind not in (Kind.STAGING, Kind.TMP):
            continue
        try:
            age = now - os.lstat(step_dir / name).st_mtime
        except OSError:
            continue  # finished meanwhile
        if not is_stale(res, age):
            return True
    return False


@dataclass(frozen=True)
class MemorySettings:
    """What the tier needs from the configuration (0 means "off" for the cadence numbers)."""

    root: Path  # the job's directory: <memory_dir>/rlsup-<job>
    keep_last: int = 2
    limit_bytes: int = 0
    disk_every: int = 0
    disk_every_seconds: float = 0.0
    node: int = 0  # this node's rank, of ``nodes``
    nodes: int = 1

    @classmethod
    def from_config(cls, cfg: "SupervisorConfig", job: str, node: int = 0,
                    nodes: int = 1) -> "MemorySettings | None":
        """None when ``memory_dir`` is empty (the tier is off)."""
        if not cfg.memory_dir:
            return None
        return cls(job_memory_dir(cfg.memory_dir, job, node if nodes > 1 else None), cfg.memory_keep_last,
                   cfg.memory_limit_bytes, cfg.disk_every, cfg.disk_every_seconds, node, nodes)

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    @property
    def wake_interval(self) -> float:
        """Seconds between passes when nothing wakes the thread: a tenth of a time cadence, at most 5 s."""
        if self.disk_every_seconds:
            return max(0.05, min(IDLE_WAKE_S, self.disk_every_seconds / 10))
        return IDLE_WAKE_S


@dataclass(frozen=True)
class Drained:
    """One step copied from memory to disk."""

    step: int
    parts: int
    bytes_written: int
    seconds: float


class MemoryTier:
    """The job's memory tier on this node; see the module docstring."""

    def __init__(self, settings: MemorySettings, checkpoint_dir: str | os.PathLike, job: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.root = settings.root
        self.checkpoint_dir = Path(checkpoint_dir)
        self.job = job
        self.parts = NodeParts(settings.node, settings.nodes, job)
        self._clock = clock
        self._last_step: int | None = None  # newest step on disk the cadence counts from
        self._last_time: float | None = None
        self._protected: Path | None = None  # the step (in memory or on disk) a restore uses
        self._retain_paused = False  # while the nodes agree on a resume step (several nodes)
        self._final = False
        self._last_clean: float | None = None
        self._lock = threading.Lock()
        self._retain_lock = threading.Lock()  # a pause waits for a pruning pass, not for a drain
        self._loop = PollLoop(self.poll, "rlsup-memory-tier", self._pass_failed)
        self.drains: list[Drained] = []
        self.last_error: str | None = None

    @classmethod
    def from_config(cls, cfg: "SupervisorConfig", checkpoint_dir: str | os.PathLike, job: str, node: int = 0,
                    nodes: int = 1) -> "MemoryTier | None":
        settings = MemorySettings.from_config(cfg, job, node, nodes)
        return cls(settings, checkpoint_dir, job) if settings is not None else None

    def env(self) -> dict[str, str]:
        """What every rank of an attempt is told (read by :mod:`trainer_hooks.memory_tier`)."""
        return {job_env.MEMORY_DIR: str(self.root), job_env.MEMORY_KEEP_LAST: str(self.settings.keep_last),
                job_env.MEMORY_LIMIT_BYTES: str(self.settings.limit_bytes)}

    # ---------------------------------------------------------------- reading

    def whole_steps(self, full: bool = True, root: Path | None = None) -> list[tuple[int, Path]]:
        """(step, path) of the steps of this job whose parts of this node all verify in the tier (or in
        ``root``), oldest first: whole steps on one node."""
        return [(step, path) for step, path in list_step_dirs(root or self.root)
                if self.parts.whole(path, full) is not None]

    def newest_valid(self, full: bool = True, root: Path | None = None) -> tuple[int, Path] | None:
        """(step, path) of the newest step of this job whose parts of this node all verify in the tier
        (or in ``root``): the newest valid step on one node."""
        for step, path in reversed(list_step_dirs(root or self.root)):
            if self.parts.whole(path, full) is not None:
                return step, path
        return None

    def inventory(self, known: KnownDigests | None = None) -> NodeInventory:
        """Every valid part of this job in the tier, fully verified: parts in place on this node. ``known``: the
        restart's checksums; the ones computed here are kept in it, so :meth:`resume_dir` hashes nothing again."""
        held = InventoryBuilder(self.settings.node)
        for step, path in list_step_dirs(self.root):
            for rank, m in self.parts.valid_parts(path, full=True, known=known).items():
                owner = m.extra.get("node_rank")
                held.add(step, m.world_size, rank, owner if isinstance(owner, int) else self.settings.node,
                         resize=resize_of(m))
        return held.build()

    def resume_dir(self, step: int, known: KnownDigests | None = None) -> Path | None:
        """The tier's directory of ``step`` when every part of this node's ranks verifies there (every
        checksum; ``known``: checksums of files unchanged since :meth:`inventory`), so each rank of the node loads
        it in place; else None."""
        path = self.root / step_dir_name(step)
        return path if self.parts.whole(path, full=True, strict=True, known=known) is not None else None

    def copy_to_disk(self, step: int) -> int:
        """Copy the tier's valid parts of ``step`` that ``checkpoint_dir`` lacks there (a resume that
        reads the rest from disk); valid parts on disk are kept. Returns the parts written."""
        src = LocalStore(self.root, hold_label=HOLD_LABEL)
        dst = LocalStore(self.checkpoint_dir, hold_label=HOLD_LABEL)
        written = 0
        with self._lock:
            for rank in sorted(self.parts.valid_parts(src.path(step), full=False)):
                written += copy_part(src, dst, step, rank, full=True, accept=self.parts.accept).written
        return written

    def protect(self, path: Path | None) -> None:
        """Retention keeps ``path`` (the step the next attempt resumes from, in memory or on disk)."""
        self._protected = path.resolve() if path is not None else None

    def supersede(self, resume_step: int | None) -> list[int]:
        """An attempt is launched from ``resume_step`` (None: from scratch): the tier's steps newer than it
        belong to the abandoned timeline (several nodes resume from the newest step whole on all of them,
        so one node may hold newer steps of its own). They are removed before the ranks start, so they are
        never drained, resumed from or counted by retention, and a new save of the same step never finds
        the old part "already valid" (a job resuming from data that is not its own). On several nodes the
        parts of such steps drained to ``checkpoint_dir`` lose their manifests too (:meth:`_invalidate_on_disk`).
        Returns the steps removed from the tier."""
        with self._lock, self._retain_lock:  # after a drain or pruning pass under way
            if self.settings.multi_node:
                self._invalidate_on_disk(resume_step)
            doomed = [step for step, _ in list_step_dirs(self.root) if resume_step is None or step > resume_step]
            store = LocalStore(self.root, hold_label=HOLD_LABEL)
            for step in doomed:
                store.delete(step)  # renamed out of the step namespace first: gone at once for every reader
            if doomed:
                log.warning("memory tier: steps %s of an earlier attempt are newer than step %s this attempt "
                            "resumes from: removed from %s (this attempt writes its own)",
                            ", ".join(map(str, doomed)), resume_step, self.root)
            if resume_step is None or (self._last_step is not None and self._last_step > resume_step):
                self._last_step = resume_step  # the drain cadence counts from this timeline's steps
            return doomed

    def _invalidate_on_disk(self, resume_step: int | None) -> None:
        """Several nodes: this job's valid parts of steps newer than ``resume_step`` in ``checkpoint_dir``
        (the abandoned timeline's, drained before) lose their manifests, the protocol's way to make a part
        invalid, so the new timeline's drain of that step rewrites them instead of keeping them as valid,
        and no newer step on disk stops it draining. Other files and other jobs' parts are left alone."""
        store = LocalStore(self.checkpoint_dir, hold_label=HOLD_LABEL)
        for step, path in list_step_dirs(self.checkpoint_dir):
            if resume_step is not None and step <= resume_step:
                continue
            ranks = sorted(self.parts.valid_parts(path, full=False))
            for rank in ranks:
                store.remove_manifest(step, rank)
            if ranks:
                log.warning("memory tier: step %d in %s is newer than step %s this attempt resumes from: its "
                            "parts of ranks %s are no longer valid", step, self.checkpoint_dir, resume_step,
                            ", ".join(map(str, ranks)))

    def pause_retention(self, paused: bool) -> None:
        """Several nodes: no memory step is removed while the nodes agree on the step to resume from
        (returns once a pruning pass under way is over)."""
        with self._retain_lock:
            self._retain_paused = paused

    # ---------------------------------------------------------------- draining

    def _due(self, step: int) -> bool:
        s = self.settings
        if self._last_step is not None and step <= self._last_step:
            return False
        if self._final or self._last_step is None or not (s.disk_every or s.disk_every_seconds):
            return True
        by_steps = bool(s.disk_every) and step - self._last_step >= s.disk_every
        by_time = bool(s.disk_every_seconds) and (
            self._last_time is None or self._clock() - self._last_time >= s.disk_every_seconds)
        return by_steps or by_time

    def _crosses(self, step: int) -> bool:
        """Several nodes: ``step`` is at or past the next multiple of ``disk_every`` after the last drain."""
        every = self.settings.disk_every or 1
        return self._last_step is None or (step > self._last_step and step // every > self._last_step // every)

    def _to_drain(self) -> int | None:
        """The step to drain now, if any: the newest whole one when due (one node); on several nodes the
        oldest one that crosses a multiple of ``disk_every`` (the same step on every node)."""
        whole = [step for step, _ in self.whole_steps(full=False)]
        if not whole:
            return None
        if self._final or not self.settings.multi_node:
            return whole[-1] if self._due(whole[-1]) else None
        return next((step for step in whole if self._crosses(step)), None)

    def poll(self) -> Drained | None:
        """One pass: drain a memory step if one is due; prune the disk after a drain (and, on several
        nodes, the tier itself)."""
        with self._lock:
            self._maybe_clean()
            step = self._to_drain()
            drained = None
            if step is not None:
                on_disk = self.newest_valid(full=False, root=self.checkpoint_dir)
                if on_disk is not None and on_disk[0] >= step:  # the trainer saved it to disk itself
                    self._last_step, self._last_time = on_disk[0], self._clock()
                else:
                    drained = self._drain(step)
            if self.settings.multi_node:
                with self._retain_lock:
                    if not self._retain_paused:
                        self._retain(self.root, self.settings.keep_last, keep=None if drained else step)
            return drained

    def _drain(self, step: int) -> Drained | None:
        src = LocalStore(self.root, hold_label=HOLD_LABEL)
        dst = LocalStore(self.checkpoint_dir, hold_label=HOLD_LABEL)
        t0, written, parts = time.monotonic(), 0, 0
        try:
            with src.hold(step):  # the whole step, not part by part: the trainer's retention waits
                own = self.parts.whole(src.path(step), full=False)
                if own is None:
                    raise PartError(f"step {step}: this node's parts are no longer all valid in {self.root}")
                for rank in sorted(own):
                    done = copy_part(src, dst, step, rank, full=True, accept=self.parts.accept)
                    parts += 1
                    written += done.size if done.written else 0
        except (OSError, ManifestError, PartError) as e:
            self.last_error = f"step {step}: {e}"
            log.warning("memory tier: step %d not drained from %s to %s: %s", step, self.root,
                        self.checkpoint_dir, e)
            return None
        self.last_error = None
        self._last_step, self._last_time = step, self._clock()
        drained = Drained(step, parts, written, time.monotonic() - t0)
        self.drains.append(drained)
        log.info("memory tier: step %d drained to %s (%d parts, %d bytes, %.2fs)", step, self.checkpoint_dir,
                 parts, written, drained.seconds)
        self._retain(self.checkpoint_dir, next(iter(own.values())).extra.get("disk_keep_last"), keep=step)
        return drained

    def _retain(self, root: Path, keep_last: object, keep: int | None = None) -> list[int]:
        """``keep_last`` on ``root`` (:mod:`rlsup_format.retention`): the trainer's on ``checkpoint_dir``,
        which it records in each memory manifest (none recorded: keep everything); ``memory_keep_last``
        on the tier itself on several nodes. Valid = this node's parts all verify (sizes). Protected:
        ``keep`` (the step just drained, or one due but not drained) and invalid steps newer than it,
        held steps, the resume step, steps a live process is writing (:func:`being_written`); where
        this node's ranks are unknown nothing is removed."""
        if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
            return []
        states = []
        for step, path in list_step_dirs(root):
            parts = self.parts.whole(path, full=False, strict=True)
            if parts is None and self.parts.whole(path, full=False) is not None:
                return []  # an uneven world: which ranks are this node's is a guess; delete nothing
            protected = (step == keep or (keep is not None and step > keep and parts is None) or is_held(path)
                         or (self._protected is not None and path.resolve() == self._protected)
                         or (parts is None and being_written(path)))
            states.append(StepState(step, parts is not None, protected))
        doomed = steps_to_delete(states, keep_last)
        store = LocalStore(root, hold_label=HOLD_LABEL)
        for step in doomed:
            log.log(logging.DEBUG if root == self.root else logging.INFO,
                    "memory tier: retention (keep_last %d) removes step %d from %s", keep_last, step, root)
            store.delete(step)
        return doomed

    def _maybe_clean(self) -> None:
        """Temp files and holds of killed copies, in both directories, at most every CLEAN_EVERY_S."""
        now = time.monotonic()
        if self._last_clean is None or now - self._last_clean >= CLEAN_EVERY_S:
            self._last_clean = now
            LocalStore(self.root).clean()
            LocalStore(self.checkpoint_dir).clean()

    # ---------------------------------------------------------------- background thread

    def start(self) -> None:
        """Create the job's directory and drain in a daemon thread until :meth:`stop`."""
        self.root.mkdir(parents=True, exist_ok=True)
        kind = filesystem_type(self.root)
        if kind not in RAM_FILESYSTEMS:
            log.info("memory tier %s is on %s, not a tmpfs: saves there cost what a disk write costs",
                     self.root, kind or "an unknown filesystem")
        on_disk = self.newest_valid(full=False, root=self.checkpoint_dir)
        self._last_step = on_disk[0] if on_disk is not None else None
        self._last_time = self._clock()
        # A new step is drained as soon as its last manifest appears (when due).
        self._loop.start(self.settings.wake_interval, watch=self.root)

    def _pass_failed(self, e: Exception) -> None:
        self.last_error = str(e)

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop the thread after its current drain (a drain in progress is finished, not torn)."""
        self._loop.stop(timeout)

    def finish(self, remove: bool, timeout: float) -> int | None:
        """The run ended: stop the thread, drain the newest valid memory step if disk lacks it (whatever
        the cadence), and with ``remove`` (a successful run) remove the job's directory once disk holds
        that step. Returns the newest valid step on disk. Waits at most ``timeout`` seconds for the
        drain; a drain cut off or failed keeps the directory (its steps are still the newest)."""
        self.stop(timeout)
        self._final = True
        done = threading.Event()

        def final() -> None:
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - the tier must never kill the supervisor
                self.last_error = str(e)
                log.warning("memory tier: final drain failed: %s", e)
            done.set()

        threading.Thread(target=final, name="rlsup-memory-drain", daemon=True).start()
        drained = done.wait(timeout)
        newest = self.newest_valid(full=False)
        on_disk = self.newest_valid(full=False, root=self.checkpoint_dir)
        safe = drained and (newest is None or (on_disk is not None and on_disk[0] >= newest[0]))
        if remove and safe:
            remove_path(self.root)
            log.info("memory tier: %s removed (the run succeeded; its last step is on disk)", self.root)
        elif remove:
            log.warning("memory tier: %s kept: its newest step %s is not on %s (%s)", self.root,
                        newest[0] if newest else None, self.checkpoint_dir, self.last_error or "drain cut off")
        return on_disk[0] if on_disk is not None else None
