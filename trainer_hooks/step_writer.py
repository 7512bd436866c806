"""The one protocol that writes a rank's part of a step: used by ``CheckpointManager.save`` in the
training process and by the asynchronous writer process, so both leave exactly the same bytes.

Why a protocol and not just ``torch.save``: a rank can be SIGKILLed at any instant, and the next
attempt must find either a complete step or one that is plainly invalid. A rank's save goes:

1. ``step_dir`` is created (all ranks, ``exist_ok``), and what killed saves left there is removed;
2. if this rank's part already verifies (for collective backends: every rank's), nothing is written;
3. else its old manifest goes first, then the backend writes into a fresh staging directory
   (``rlsup_format.names.reserved_name(Kind.STAGING, ...)``), and each file is fsynced, hashed and
   renamed to its final name: a file never has its final name while partial;
4. collective backends: a barrier, so no manifest claims completeness before every rank's files
   are in place;
5. last, the rank's manifest, atomically (:func:`rlsup_format.manifest.write_manifest`);
6. rank 0 runs retention once the new step verifies complete.

Everything here takes plain data (the step, a payload, a :class:`RankIdentity`, a
:class:`StepTarget`, a backend): no manager object, so the writer process needs nothing else.
Every on-disk rule (names, leftovers, retention, digests) comes from :mod:`rlsup_format`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Union

import torch

from rlsup_format import job_env
from rlsup_format.digest import FileEntry, hash_own_file
from rlsup_format.fileio import fsync_dir, fsync_dirs, fsync_file, remove_path
from rlsup_format.leftovers import STALE_AGE_S, clean_leftovers
from rlsup_format.manifest import (
    RESIZABLE,
    SCHEMA_VERSION,
    LocalStep,
    ManifestError,
    RankManifest,
    is_held,
    list_step_dirs,
    manifest_name,
    read_manifest,
    verify_part,
    verify_step_dir,
    write_manifest,
)
from rlsup_format.names import Kind, reserved_name, staging_label, step_dir_name
from rlsup_format.retention import StepState, steps_to_delete
from trainer_hooks.backends.base import RNG_KEY, Backend, SaveContext, state_of
from trainer_hooks.rng import capture_rng_state

log = logging.getLogger(__name__)


Payload = dict[str, Any]
PayloadSource = Union[Payload, Callable[[], Payload]]


# ------------------------------------------------------------------------------ who and where


def dist_group() -> Any | None:
    """``torch.distributed`` when a process group is initialised, else None (one rank alone)."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


@dataclass(frozen=True)
class RankIdentity:
    """Who writes a part: recorded in its manifest so rlsup knows which node needs it back and
    which job it belongs to. ``pid`` is the training process (an async writer adds its own)."""

    rank: int
    world_size: int
    node_rank: int | None = None
    job: str | None = None
    pid: int = field(default_factory=os.getpid)

    @classmethod
    def current(cls) -> RankIdentity:
        """This process's identity: rank and world from the process group, else from the environment."""
        dist = dist_group()
        if dist is not None:
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        node = os.environ.get(job_env.NODE_RANK, os.environ.get("GROUP_RANK"))
        node_rank = int(node) if node is not None and node.isdigit() else None
        return cls(rank, world, node_rank, os.environ.get(job_env.JOB_ID) or None, os.getpid())

    def manifest_extra(self) -> dict[str, Any]:
        """The manifest's ``extra``: the writing pid, node rank and job (when known)."""
        extra: dict[str, Any] = {"pid": self.pid}
        if self.node_rank is not None:
            extra["node_rank"] = self.node_rank
        if self.job:
            extra["job"] = self.job
        if os.getpid() != self.pid:
            extra["writer_pid"] = os.getpid()  # written in the background, by this process
        return extra


@dataclass(frozen=True)
class StepTarget:
    """Where steps go and which of them retention keeps (``resume_dir``: the step rlsup resumed
    from, never deleted while this attempt runs). ``disk_keep_last``: for a step written to rlsup's
    memory tier, the trainer's own ``keep_last``, recorded in the manifest so rlsup applies it to
    ``checkpoint_dir`` after draining the step there. ``memory``: the directory is rlsup's memory tier
    (an asynchronous save there may be a direct one, :mod:`trainer_hooks.direct_save`). ``resizable``: the
    trainer's state may be restored into another world size (:mod:`trainer_hooks.world`), recorded in the
    manifest for rlsup to read before it shrinks or grows the job."""

    directory: Path
    keep_last: int | None = None
    resume_dir: str | None = None
    disk_keep_last: int | None = None
    memory: bool = False
    resizable: bool = False

    def manifest_extra(self) -> dict[str, Any]:
        """What the target adds to each manifest's ``extra``."""
        extra: dict[str, Any] = {} if self.disk_keep_last is None else {"disk_keep_last": self.disk_keep_last}
        if self.resizable:
            extra[RESIZABLE] = True
        return extra


def build_payload(state: dict[str, Any]) -> Payload:
    """What a step holds: each entry's state (its ``state_dict()`` or the value) plus the RNG state."""
    payload = {name: state_of(obj) for name, obj in state.items()}
    if RNG_KEY in payload:
        raise ValueError(f"{RNG_KEY!r} is reserved for the RNG state")
    payload[RNG_KEY] = capture_rng_state()
    return payload


# -------------------------------------------------------------------------------- collectives


def all_ranks_agree(flag: bool) -> bool:
    """True only if ``flag`` is true on every rank (a collective when a group is initialised)."""
    dist = dist_group()
    if dist is None:
        return flag
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def failed_ranks(ok: bool, rank: int) -> list[int]:
    """Every rank whose ``ok`` is False (a collective when a group is initialised; else ``rank``)."""
    dist = dist_group()
    if dist is None:
        return [] if ok else [rank]
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, ok)
    return [r for r, f in enumerate(flags) if not f]


def barrier() -> None:
    """Wait for every rank (nothing to wait for without a process group)."""
    dist = dist_group()
    if dist is not None:
        dist.barrier()


# ------------------------------------------------------------------------------ a full disk


class CheckpointSpaceError(OSError, RuntimeError):
    """A save failed because the checkpoint filesystem is full (or over quota). torch reports a full
    disk as ``iostream error`` / ``unexpected pos``; this says what happened, with the free space and
    about how much the step needed. An OSError with errno ENOSPC, and a RuntimeError like torch's own
    error (raised ``from`` it), so existing handlers of either still catch it."""

    def __init__(self, message: str, free: int | None = None, needed: int | None = None) -> None:
        super().__init__(errno.ENOSPC, message)
        self.free = free
        self.needed = needed

    def __str__(self) -> str:
        return str(self.strerror)

    def __reduce__(self) -> Any:
        return (type(self), (self.strerror, self.free, self.needed))


_SPACE_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
# How torch's C++ writer words a failed write (it drops the errno): only these, or an EIO / errno-less
# OSError, may be blamed on the disk when free space turns out to be short.
_WRITE_FAILURE_TEXT = ("iostream error", "unexpected pos", "write failed", "PytorchStreamWriter",
                       "No space left", "Disk quota exceeded")


def _exception_chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < 32:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def payload_bytes(payload: Any) -> int | None:
    """About how many bytes ``payload`` takes on disk: tensor storages (each counted once), arrays, bytes."""
    seen: dict[int, int] = {}
    other = 0

    def walk(value: Any, depth: int) -> None:
        nonlocal other
        if depth > 64:
            return
        if isinstance(value, torch.Tensor):
            try:
                storage = value.untyped_storage()
                seen[storage.data_ptr() or id(storage)] = storage.nbytes()
            except Exception:  # noqa: BLE001 - sparse/meta tensors: their logical size will do
                other += value.numel() * value.element_size()
        elif isinstance(value, dict):
            for v in value.values():
                walk(v, depth + 1)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, depth + 1)
        elif isinstance(value, (bytes, bytearray, memoryview)):
            other += len(value)
        elif hasattr(value, "nbytes") and isinstance(value.nbytes, int):
            other += value.nbytes  # numpy arrays

    try:
        walk(payload, 0)
    except Exception:  # noqa: BLE001 - an estimate for an error message
        return None
    return sum(seen.values()) + other


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail  # root may use the reserved blocks
    return blocks * st.f_frsize


def disk_full_error(exc: BaseException, step_dir: Path, step: int, payload: Any) -> CheckpointSpaceError | None:
    """A clear :class:`CheckpointSpaceError` when the failed save ``exc`` was a full disk (ENOSPC or
    EDQUOT anywhere in its chain, or a failed write while the filesystem has less free space than the
    step needs), else None. Called after the staging directory is removed, so the free space is what
    the filesystem really has."""
    chain = _exception_chain(exc)
    codes = {getattr(e, "errno", None) for e in chain}
    texts = [str(e) for e in chain]
    by_errno = bool(codes & _SPACE_ERRNOS) or any("No space left on device" in t for t in texts)
    quota = (hasattr(errno, "EDQUOT") and errno.EDQUOT in codes) or any("Disk quota exceeded" in t for t in texts)
    looks_like_write = any((isinstance(e, OSError) and e.errno in (errno.EIO, None))
                           or any(m in t for m in _WRITE_FAILURE_TEXT) for e, t in zip(chain, texts))
    if not (by_errno or quota or looks_like_write):
        return None
    # torch's failed writer (and its open, already unlinked staging file) lives on in the finished
    # frames of the traceback until they are cleared: free them, or the space is not given back yet.
    for e in chain:
        traceback.clear_frames(e.__traceback__)
    free = _free_bytes(step_dir if step_dir.exists() else step_dir.parent)
    needed = payload_bytes(payload)
    by_space = looks_like_write and free is not None and needed is not None and free < needed + (64 << 10)
    if not (by_errno or quota or by_space):
        return None
    what = "no space left on device" + (" (disk quota exceeded)" if quota else "")
    detail = f"{free} bytes free" if free is not None else "free space unknown"
    if needed is not None:
        detail += f", step {step} needs about {needed}"
    return CheckpointSpaceError(f"checkpoint save to {step_dir} failed: {what} ({detail}); the step was not "
                                "written, older checkpoints are untouched", free, needed)


@contextlib.contextmanager
def explain_full_disk(step_dir: Path, step: int, payload: Any) -> Iterator[None]:
    """Re-raise a failed save that was a full disk as a :class:`CheckpointSpaceError` (and log it)."""
    try:
        yield
    except Exception as e:
        err = disk_full_error(e, step_dir, step, payload)
        if err is None:
            raise
        log.error("%s (original error: %s: %s)", err, type(e).__name__, e)
        raise err from e


# ------------------------------------------------------------------------------- the protocol


class CheckpointConflictError(RuntimeError):
    """The checkpoint directory holds this step from another job: two jobs share one checkpoint_dir.
    The other job's valid step is never overwritten, and this job's save must not silently vanish."""


def write_step(target: StepTarget, step: int, payload: PayloadSource, who: RankIdentity, backend: Backend,
               live: dict[str, Any] | None = None) -> Path:
    """Write ``who``'s part of ``step`` under ``target.directory`` (a collective for collective
    backends); returns the step directory. ``payload``: the payload, or a callable making it (so a
    rank whose part is already valid never builds it). ``live``: the caller's objects, for backends
    that save through them (``sharded_state_dict``)."""
    directory = Path(target.directory)
    step_dir = directory / step_dir_name(step)
    directory.mkdir(parents=True, exist_ok=True)
    step_dir.mkdir(exist_ok=True)
    fsync_dir(directory)  # the step's name is durable before anything inside it claims to be
    clean_step_leftovers(directory, step_dir, who.rank)
    mine_ok = own_part_valid(step_dir, step, who, backend.name)
    if backend.collective:
        mine_ok = all_ranks_agree(mine_ok)
    if mine_ok:
        log.info("step %d: rank %d's part is already valid; not rewritten", step, who.rank)
    else:
        try:
            _write_part(step_dir, step, payload, who, backend, live or {}, target.manifest_extra())
        except CheckpointSpaceError:
            if backend.collective or not removals_pending():
                raise
            log.warning("step %d: disk full while retention still removes old steps; waiting for it, then "
                        "writing once more", step)
            wait_for_removals()
            _write_part(step_dir, step, payload, who, backend, live or {}, target.manifest_extra())
    if backend.collective:
        barrier()  # every manifest is written: the step is complete on return, so retention can run
    if who.rank == 0 and target.keep_last is not None:
        retain(target, step)
    return step_dir


def own_part_valid(step_dir: Path, step: int, who: RankIdentity, backend_name: str) -> bool:
    """Whole step valid (then never touched; another job's raises), or this rank's manifest
    matches this step, world size and backend and its files check out."""
    path = step_dir / manifest_name(who.rank)
    if not path.exists():
        # A rank beyond the world that wrote a complete step (the job grew since): that step is never touched.
        first = step_dir / manifest_name(0)
        if not first.exists() or not _other_world(first, who.world_size) or not verify_step_dir(step_dir).valid:
            return False
        _refuse_foreign(first, who.job)
        return True
    if verify_step_dir(step_dir, full=True).valid:
        _refuse_foreign(path, who.job)
        return True  # a complete checkpoint (maybe from another world size): never touch it
    m, _ = verify_part(LocalStep(step_dir), step, who.rank, full=True)
    if m is None or (m.world_size, m.backend) != (who.world_size, backend_name):
        return False
    _refuse_foreign(path, who.job)  # another job's part is neither kept as ours nor overwritten
    return True


def _other_world(manifest_path: Path, world_size: int) -> bool:
    """Whether the manifest at ``manifest_path`` was written by a job of another world size."""
    try:
        return read_manifest(manifest_path).world_size != world_size
    except (ManifestError, OSError):
        return False


def _refuse_foreign(manifest_path: Path, job: str | None) -> None:
    """Raise when the valid step at hand belongs to another job: "already valid" must not hide that
    this job's save went nowhere."""
    try:
        theirs = read_manifest(manifest_path).extra.get("job")
    except (ManifestError, OSError):
        return
    if job and isinstance(theirs, str) and theirs != job:
        raise CheckpointConflictError(f"{manifest_path.parent} was written by job {theirs!r}, this is job {job!r}: "
                                      "two jobs share this checkpoint_dir; give each its own")


def _write_part(step_dir: Path, step: int, payload: PayloadSource, who: RankIdentity, backend: Backend,
                live: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
    """Write this rank's files and then its manifest (see the module docstring for the order)."""
    stale = step_dir / manifest_name(who.rank)
    if stale.exists():
        stale.unlink()  # first, so the step can never look complete with a half-rewritten part
        fsync_dir(step_dir)
    data = payload() if callable(payload) else payload
    # A fresh name (pid and a random token): a leftover of a killed save is never reused, and the
    # cleaner of any later save can tell from the name whether its writer is gone.
    staging = step_dir / reserved_name(Kind.STAGING, staging_label(who.rank))
    staging.mkdir()
    ctx = SaveContext(step, step_dir, staging, who.rank, who.world_size, dist_group() is not None, dict(live))
    with explain_full_disk(step_dir, step, data):  # checked after the staging dir is gone
        try:
            backend.save(ctx, data)
            files = publish(staging, step_dir, ctx.written)
        finally:
            remove_path(staging)
    if backend.collective:
        barrier()  # every rank's files are in place before any manifest claims completeness
    manifest = RankManifest(schema=SCHEMA_VERSION, step=step, world_size=who.world_size, rank=who.rank,
                            backend=backend.name, files=files, created=time.time(),
                            extra={**who.manifest_extra(), **(extra or {})})
    with explain_full_disk(step_dir, step, data):
        write_manifest(step_dir, manifest)  # last: its presence means this rank's files are all there


def publish(staging: Path, step_dir: Path, written: dict[str, FileEntry] | None = None) -> dict[str, FileEntry]:
    """Rename each staged file to its final name and return every file's entry.

    A file in ``written`` was hashed and fsynced as its serializer wrote it (its size is checked, not
    its bytes re-read); any other was written by a library on its own and is fsynced and hashed here,
    from what the filesystem holds. Either way a file under its final name is whole. New
    subdirectories are synced here; ``step_dir`` itself is synced once, by the manifest's write that
    follows (a manifest whose files' renames were lost in a crash names missing files: an invalid
    part, never a torn one), except when a rename replaced a file of an earlier, invalid part: then at
    once, so such a manifest can never meet the old bytes."""
    written = written or {}
    files: dict[str, FileEntry] = {}
    dirs: set[Path] = set()
    replaced = False
    for src in sorted(p for p in staging.rglob("*") if p.is_file()):
        rel = src.relative_to(staging).as_posix()
        entry = written.get(rel)
        if entry is None or entry.size != src.stat().st_size:
            fsync_file(src)
            entry = hash_own_file(src)  # our own staging file: nobody else can change it
        files[rel] = entry
        dst = step_dir / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        replaced = replaced or dst.exists()
        os.replace(src, dst)
        parent = dst.parent
        while parent != step_dir and step_dir in parent.parents:
            dirs.add(parent)  # each new subdirectory, and (below) the directory that names it
            parent = parent.parent
    if replaced:
        dirs.add(step_dir)
    fsync_dirs(dirs)
    return files


# ----------------------------------------------------------------------- leftovers, retention


def clean_step_leftovers(directory: Path, step_dir: Path, rank: int) -> None:
    """Remove what killed saves left behind (:func:`rlsup_format.leftovers.clean_leftovers`): every
    rank removes staging dirs and temp manifests whose writer is a gone process of this host (a live
    one's are never touched); rank 0 also removes those older than ``STALE_AGE_S`` (writers on other
    hosts) and steps whose deletion was interrupted. In ``directory`` itself: a gone writer's spare
    file (:mod:`trainer_hooks.direct_save`)."""
    stale_age = STALE_AGE_S if rank == 0 else None
    clean_leftovers(directory, {Kind.STAGING}, stale_age=None)  # a spare may be old and in use: by pid only
    dirs = [p for _, p in list_step_dirs(directory)]
    if step_dir not in dirs:
        dirs.append(step_dir)
    for d in dirs:
        clean_leftovers(d, {Kind.STAGING, Kind.TMP}, stale_age=stale_age)
    if rank == 0:
        clean_leftovers(directory, {Kind.DELETING}, stale_age=STALE_AGE_S)


def retain(target: StepTarget, new_step: int) -> list[int]:
    """keep_last on rank 0, only once the new step is complete (:mod:`rlsup_format.retention`);
    returns the steps deleted. Protected: the new step, the resume step, held steps, and invalid
    steps newer than the new one (another save may still be writing them)."""
    directory = Path(target.directory)
    # Sizes and manifests: every byte of the step was hashed by the rank that wrote it, as it wrote it.
    if not verify_step_dir(directory / step_dir_name(new_step), full=False).valid:
        log.info("%s not complete yet (other ranks still writing?); retention waits", step_dir_name(new_step))
        return []
    resume = Path(target.resume_dir).resolve() if target.resume_dir else None
    states = []
    for step, path in list_step_dirs(directory):
        valid = verify_step_dir(path, full=False).valid
        protected = (step == new_step or (step > new_step and not valid)
                     or (resume is not None and path.resolve() == resume) or is_held(path))
        states.append(StepState(step, valid, protected))
    doomed = steps_to_delete(states, target.keep_last)
    for step in doomed:
        delete_step(directory, step)
    return doomed


def delete_step(directory: Path, step: int) -> None:
    """Rename out of the step namespace first, so a half-deleted step never looks like one; a
    deletion cut short is finished by rank 0's next leftover cleaning."""
    path = directory / step_dir_name(step)
    doomed = directory / reserved_name(Kind.DELETING, path.name)
    try:
        os.rename(path, doomed)
    except OSError as e:
        log.warning("retention could not remove %s: %s", path, e)
        return
    fsync_dir(directory)
    log.info("retention removed %s", path.name)
    _remove_in_background(doomed)


_remover: concurrent.futures.ThreadPoolExecutor | None = None
_remover_pid = 0  # a forked child (a DataLoader worker) starts its own: the parent's thread is not in it
_remover_lock = threading.Lock()
_removing = [0]  # removals submitted and not finished


def _remove_counted(path: Path) -> None:
    try:
        remove_path(path)
    finally:
        with _remover_lock:
            _removing[0] -= 1


def _remove_in_background(path: Path) -> None:
    """Remove a step already renamed out of the step namespace, off the caller's thread: no reader can
    see it any more, and unlinking a large file costs about a quarter second per GB on an ext4 mounted
    with ``discard`` that a synchronous save need not wait for. One worker thread, not a daemon, so a
    process that exits normally finishes its removals first; one killed meanwhile leaves a
    ``.deleting-`` directory that rank 0's next save removes (:func:`clean_step_leftovers`)."""
    global _remover, _remover_pid
    with _remover_lock:
        if _remover is None or _remover_pid != os.getpid():
            _remover = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlsup-retention")
            _remover_pid = os.getpid()
            _removing[0] = 0
        _removing[0] += 1
        _remover.submit(_remove_counted, path)


def removals_pending() -> bool:
    """Whether a background removal of this process may still be running (its space not yet free)."""
    with _remover_lock:
        remover = _remover if _remover_pid == os.getpid() else None
    return remover is not None and _removing[0] > 0


def wait_for_removals() -> None:
    """Block until every background removal submitted so far is done (a barrier for tests and close)."""
    with _remover_lock:
        remover = _remover if _remover_pid == os.getpid() else None
    if remover is not None:
        remover.submit(lambda: None).result()
