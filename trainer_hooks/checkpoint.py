"""Atomic, verified checkpoints from inside every training rank, and exact restore.

Why a protocol and not just ``torch.save``: a rank can be SIGKILLed (OOM, preemption, a hang
timeout) at any instant, and the restarted job must then resume from a checkpoint that is complete.
So a rank's save goes:

1. ``step_dir`` is created (all ranks, ``exist_ok``);
2. the backend writes this rank's files into ``step_dir/.staging-rank_<R>-<pid>/``;
3. each file is fsynced, hashed (xxh3-128), and renamed to its final name in ``step_dir`` - a file
   never has its final name while partial; the directories are fsynced;
4. last, the rank's manifest ``manifest.rank_<R>.json`` is written atomically.

A step is valid only when all ranks' manifests are present and every listed file checks out
(:mod:`rlsup_format.manifest`); anything else is ignored by restore and by the supervisor.

Never losing data: a step that is already fully valid is never touched, and a rank whose own part of
the step already verifies does not rewrite it (for collective backends the ranks decide together).
Retention (``keep_last``) runs on rank 0 only once the new step verifies complete, and never deletes
the newest valid step, a held step (``.hold-*`` marker) or the step named by ``RLSUP_RESUME_DIR``.

Asynchronous saves (``async_save=True``, torch backend): ``save()`` returns once the state is copied
and a writer process runs the same protocol in the background; see :mod:`trainer_hooks.async_writer`.

Usage::

    ckpt = CheckpointManager(keep_last=3)             # directory from RLSUP_CHECKPOINT_DIR
    state = {"model": model, "optim": optim, "sched": sched, "loader": loader, "epoch": 0}
    step = ckpt.restore(state)                        # 0 on a fresh start; plain values replaced
    while step < total:
        ...; step += 1
        if step % 100 == 0 or should_stop():
            ckpt.save(step, state)
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from trainer_hooks.backends import get_backend
from trainer_hooks.backends.base import RNG_KEY, LoadContext, SaveContext, state_of
from trainer_hooks.heartbeat import section, should_stop
from rlsup_format.manifest import (
    SCHEMA_VERSION,
    FileEntry,
    ManifestError,
    RankManifest,
    VerifyResult,
    check_files,
    fsync_dir,
    hash_file,
    is_held,
    latest_valid,
    list_step_dirs,
    manifest_name,
    read_manifest,
    step_dir_name,
    verify_step_dir,
    write_manifest,
)
from trainer_hooks.rng import capture_rng_state, restore_rng_state

log = logging.getLogger(__name__)

ENV_DIR = "RLSUP_CHECKPOINT_DIR"
#: Set by rlsup for every attempt: a step directory to load (every rank must), or empty for a fresh start.
ENV_RESUME = "RLSUP_RESUME_DIR"
ENV_RESUME_STEP = "RLSUP_RESUME_STEP"
ENV_JOB = "RLSUP_JOB_ID"
STAGING_PREFIX = ".staging-"
DELETING_PREFIX = ".deleting-"
#: Leftovers older than this are removed even when their pid looks alive (pid reuse, other hosts).
STALE_AGE_S = 3600.0


def _dist() -> Any | None:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank_world() -> tuple[int, int]:
    dist = _dist()
    if dist is not None:
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _manifest_extra() -> dict[str, Any]:
    """Who wrote the part: the node rank tells rlsup which node needs it back after a loss."""
    extra: dict[str, Any] = {"pid": os.getpid()}
    node = os.environ.get("RLSUP_NODE_RANK", os.environ.get("GROUP_RANK"))
    if node is not None and node.isdigit():
        extra["node_rank"] = int(node)
    job = os.environ.get(ENV_JOB)
    if job:
        extra["job"] = job  # which job the part belongs to: rlsup never offers it to another
    return extra


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def _payload_bytes(payload: Any) -> int | None:
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
        elif hasattr(value, "nbytes") and isinstance(getattr(value, "nbytes"), int):
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
    needed = _payload_bytes(payload)
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
def _explain_full_disk(step_dir: Path, step: int, payload: Any) -> Any:
    """Re-raise a failed save that was a full disk as a :class:`CheckpointSpaceError` (and log it)."""
    try:
        yield
    except Exception as e:
        err = disk_full_error(e, step_dir, step, payload)
        if err is None:
            raise
        log.error("%s (original error: %s: %s)", err, type(e).__name__, e)
        raise err from e


def _all_ranks_agree(flag: bool) -> bool:
    """True only if ``flag`` is true on every rank (a collective when a group is initialised)."""
    dist = _dist()
    if dist is None:
        return flag
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _failed_ranks(ok: bool) -> list[int]:
    """Every rank whose ``ok`` is False (a collective when a group is initialised)."""
    dist = _dist()
    if dist is None:
        return [] if ok else [_rank_world()[0]]
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, ok)
    return [r for r, f in enumerate(flags) if not f]


class ResumeError(RuntimeError):
    """rlsup named a step to resume from (``RLSUP_RESUME_DIR``) and it cannot be loaded here. The
    attempt fails loudly instead of quietly starting over: a rank that started fresh while its peers
    resumed, or every rank starting fresh after rlsup said "from step N", would lose the run's progress."""


class CheckpointConflictError(RuntimeError):
    """The checkpoint directory holds this step from another job: two jobs share one checkpoint_dir.
    The other job's valid step is never overwritten, and this job's save must not silently vanish."""


def _refuse_foreign(manifest_path: Path) -> None:
    job = os.environ.get(ENV_JOB)
    try:
        theirs = read_manifest(manifest_path).extra.get("job")
    except (ManifestError, OSError):
        return
    if job and isinstance(theirs, str) and theirs != job:
        raise CheckpointConflictError(f"{manifest_path.parent} was written by job {theirs!r}, this is job {job!r}: "
                                      "two jobs share this checkpoint_dir; give each its own")


def _barrier() -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier()


class CheckpointManager:
    """Save and restore a dict of stateful objects and plain values, atomically and verifiably."""

    def __init__(self, directory: str | os.PathLike | None = None, keep_last: int | None = None,
                 backend: str = "torch", safe_globals: tuple | list = (), async_save: bool = False,
                 max_in_flight: int = 1, when_busy: str = "wait", keep_buffers: bool = True) -> None:
        """``async_save=True``: :meth:`save` returns once the state is copied; a writer process writes
        it (:mod:`trainer_hooks.async_writer`). At most ``max_in_flight`` saves are in flight; a save
        beyond that waits (``when_busy="wait"``) or is skipped and returns None (``"skip"``).
        ``keep_buffers`` keeps the snapshot buffers (pinned with CUDA) for the next save."""
        directory = directory if directory is not None else os.environ.get(ENV_DIR)
        if not directory:
            raise ValueError(f"no checkpoint directory: pass directory= or set {ENV_DIR}")
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be >= 1 (or None to keep everything)")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.backend_name = backend
        self.backend = get_backend(backend)
        self.safe_globals = tuple(safe_globals)
        self.rank, self.world_size = _rank_world()
        self._async = None
        if async_save:
            if self.backend.collective:
                raise NotImplementedError(
                    f"async_save=True is implemented for the 'torch' backend only; the {backend!r} backend's "
                    "save is a collective that every rank must run in the training process "
                    "(use async_save=False, or backend='torch')")
            from trainer_hooks.async_writer import AsyncSaver

            self._async = AsyncSaver(max_in_flight, when_busy, keep_buffers)

    # ----------------------------------------------------------------------------------- save

    def save(self, step: int, state: dict[str, Any]) -> Path | None:
        """Write ``state`` as step ``step`` (a collective for the dcp/megatron backends).

        With ``async_save=True`` it returns once the state is copied (the step becomes valid when the
        writer finishes; :meth:`wait` flushes), and None when the save was skipped (``when_busy="skip"``).
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self._async is not None:
            with section("save"):  # only the blocking part: a free slot and the copy
                return self._async.save(self, step, state, preempted=should_stop())
        with section("save"):
            self.rank, self.world_size = _rank_world()
            return self._save_prepared(step, lambda: self._payload(state), state)

    def _payload(self, state: dict[str, Any]) -> dict[str, Any]:
        payload = {name: state_of(obj) for name, obj in state.items()}
        if RNG_KEY in payload:
            raise ValueError(f"{RNG_KEY!r} is reserved for the RNG state")
        payload[RNG_KEY] = capture_rng_state()
        return payload

    def _save_prepared(self, step: int, make_payload: Any, live: dict[str, Any],
                       extra: dict[str, Any] | None = None) -> Path:
        """The save protocol once rank and world are known; the async writer process runs it too."""
        step_dir = self.directory / step_dir_name(step)
        self.directory.mkdir(parents=True, exist_ok=True)
        step_dir.mkdir(exist_ok=True)
        fsync_dir(self.directory)
        self._clean_leftovers(step_dir)
        mine_ok = self._own_part_valid(step_dir, step)
        if self.backend.collective:
            mine_ok = _all_ranks_agree(mine_ok)
        if mine_ok:
            log.info("step %d: rank %d's part is already valid; not rewritten", step, self.rank)
        else:
            self._write_part(step, step_dir, make_payload, live, extra)
        if self.backend.collective:
            _barrier()  # every manifest is written: the step is complete on return, so retention can run
        if self.rank == 0 and self.keep_last is not None:
            self._retain(step_dir)
        return step_dir

    def _own_part_valid(self, step_dir: Path, step: int) -> bool:
        """Whole step valid, or this rank's manifest matches this job and its files check out."""
        path = step_dir / manifest_name(self.rank)
        if not path.exists():
            return False
        if verify_step_dir(step_dir, full=True).valid:
            _refuse_foreign(path)
            return True  # a complete checkpoint (maybe from another world size): never touch it
        try:
            m = read_manifest(path)
        except (ManifestError, OSError):
            return False
        if (m.step, m.world_size, m.rank, m.backend) != (step, self.world_size, self.rank, self.backend.name):
            return False
        reason, _ = check_files(step_dir, m.files, full=True)
        return not reason

    def _write_part(self, step: int, step_dir: Path, make_payload: Any, live: dict[str, Any],
                    extra: dict[str, Any] | None = None) -> None:
        stale = step_dir / manifest_name(self.rank)
        if stale.exists():
            stale.unlink()  # first, so the step can never look complete with a half-rewritten part
            fsync_dir(step_dir)
        payload = make_payload()
        staging = step_dir / f"{STAGING_PREFIX}rank_{self.rank:05d}-{os.getpid()}"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
        ctx = SaveContext(step, step_dir, staging, self.rank, self.world_size, _dist() is not None, dict(live))
        with _explain_full_disk(step_dir, step, payload):  # checked after the staging dir is gone
            try:
                self.backend.save(ctx, payload)
                files = self._publish(staging, step_dir)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        if self.backend.collective:
            _barrier()  # every rank's files are in place before any manifest claims completeness
        manifest = RankManifest(schema=SCHEMA_VERSION, step=step, world_size=self.world_size, rank=self.rank,
                                backend=self.backend.name, files=files, created=time.time(),
                                extra=extra if extra is not None else _manifest_extra())
        with _explain_full_disk(step_dir, step, payload):
            write_manifest(step_dir, manifest)

    @staticmethod
    def _publish(staging: Path, step_dir: Path) -> dict[str, FileEntry]:
        """fsync + hash each staged file, rename it to its final name, fsync the directories."""
        files: dict[str, FileEntry] = {}
        dirs: set[Path] = set()
        for src in sorted(p for p in staging.rglob("*") if p.is_file()):
            rel = src.relative_to(staging).as_posix()
            fd = os.open(src, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            files[rel] = hash_file(src)
            dst = step_dir / rel
            if dst.parent != step_dir and not dst.parent.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                dirs.add(dst.parent.parent)
            os.replace(src, dst)
            dirs.add(dst.parent)
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            fsync_dir(d)
        return files

    # --------------------------------------------------------------------------- housekeeping

    def _clean_leftovers(self, step_dir: Path) -> None:
        """Remove what killed saves left behind: this rank's staging dirs and temp manifests from
        dead (or long gone) processes; rank 0 also any rank's that are old, and dead deletions."""
        now = time.time()
        me = f"rank_{self.rank:05d}-"
        dirs = [p for _, p in list_step_dirs(self.directory)]
        if step_dir not in dirs:
            dirs.append(step_dir)
        for d in dirs:
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            for e in entries:
                if e.name.startswith(STAGING_PREFIX):
                    owner = e.name[len(STAGING_PREFIX):]
                    pid_text = owner.rsplit("-", 1)[-1]
                elif e.name.startswith(".manifest.rank_") and ".tmp-" in e.name:
                    owner = f"rank_{e.name[len('.manifest.rank_'):].split('.', 1)[0]}-"
                    pid_text = e.name.split(".tmp-", 1)[1].split("-", 1)[0]
                else:
                    continue
                pid = int(pid_text) if pid_text.isdigit() else -1
                if pid == os.getpid():
                    continue
                try:
                    age = now - e.stat(follow_symlinks=False).st_mtime
                except OSError:
                    continue
                ours_and_dead = owner.startswith(me) and not _pid_alive(pid)
                if ours_and_dead or (self.rank == 0 and age > STALE_AGE_S):
                    self._remove(Path(e.path))
        if self.rank == 0:
            try:
                entries = list(os.scandir(self.directory))
            except OSError:
                entries = []
            for e in entries:
                if e.name.startswith(DELETING_PREFIX):
                    pid_text = e.name.rsplit("-", 1)[-1]
                    if not (pid_text.isdigit() and _pid_alive(int(pid_text))):
                        self._remove(Path(e.path))

    @staticmethod
    def _remove(path: Path) -> None:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def _retain(self, new_step_dir: Path) -> None:
        """keep_last on rank 0, only once the new step is complete; protected steps always stay."""
        if not verify_step_dir(new_step_dir, full=True).valid:
            log.info("%s not complete yet (other ranks still writing?); retention waits", new_step_dir.name)
            return
        protected = {new_step_dir.resolve()}
        resume = os.environ.get(ENV_RESUME)
        if resume:
            protected.add(Path(resume).resolve())
        steps = list_step_dirs(self.directory)
        valid_kept = 0
        newest_valid_seen = False
        new_step = int(new_step_dir.name.split("_")[1])
        for step, path in reversed(steps):
            if step > new_step:
                # Newer than what we just saved (an old step re-saved?): leave it alone.
                if verify_step_dir(path, full=False).valid:
                    valid_kept += 1
                    newest_valid_seen = True
                continue
            valid = verify_step_dir(path, full=False).valid
            if valid and valid_kept < self.keep_last:
                valid_kept += 1
                newest_valid_seen = True
                continue
            if not newest_valid_seen:
                continue  # invalid and newer than every valid step: maybe still being written
            if path.resolve() in protected or is_held(path):
                continue
            self._delete_step(path)

    def _delete_step(self, path: Path) -> None:
        """Rename out of the step namespace first, so a half-deleted step never looks like one."""
        doomed = path.with_name(f"{DELETING_PREFIX}{path.name}-{os.getpid()}")
        try:
            os.rename(path, doomed)
        except OSError as e:
            log.warning("retention could not remove %s: %s", path, e)
            return
        fsync_dir(self.directory)
        log.info("retention removed %s", path.name)
        shutil.rmtree(doomed, ignore_errors=True)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no save is in flight (True), or ``timeout`` seconds passed (False).

        Raises :class:`trainer_hooks.async_writer.AsyncSaveError` when a background save failed.
        Synchronous saves are never in flight, so then it returns True at once."""
        if self._async is None:
            return True
        return self._async.wait(timeout)

    def close(self) -> None:
        """Flush in-flight saves and stop the writer process (also done at interpreter exit)."""
        if self._async is not None:
            self._async.close()

    # -------------------------------------------------------------------------------- restore

    def choose(self) -> VerifyResult | None:
        """The step to resume from: the one rlsup named (``RLSUP_RESUME_DIR``; it must verify, else
        :class:`ResumeError`), none when rlsup said "fresh" (empty), else the newest valid step."""
        resume = self._rlsup_resume()
        if resume == "":
            return None
        if resume is not None:
            result = verify_step_dir(resume, full=True)
            if not result.valid:
                raise ResumeError(f"rlsup named {resume} to resume from, but it is not a valid checkpoint here: "
                                  f"{result.reason}")
            return result
        return latest_valid(self.directory, full=True)

    def _rlsup_resume(self) -> str | None:
        """rlsup's decision for this manager's directory: a step directory, "" (start fresh), or None
        (not under rlsup, or this manager writes somewhere rlsup does not watch: choose here)."""
        resume = os.environ.get(ENV_RESUME)
        if resume is None:
            return None
        watched = os.environ.get(ENV_DIR)
        mine = os.path.realpath(self.directory)
        if resume:
            return resume if os.path.realpath(os.path.dirname(resume.rstrip("/"))) == mine else None
        return "" if watched and os.path.realpath(watched) == mine else None

    def _own_part_problem(self, step_dir: Path) -> str:
        """Why this rank's part of ``step_dir`` cannot be loaded ("" when it verifies: all a per-rank
        backend reads)."""
        path = step_dir / manifest_name(self.rank)
        try:
            m = read_manifest(path)
        except (ManifestError, OSError) as e:
            return f"{path} is missing or unreadable ({e.__class__.__name__}: {e})"
        if m.world_size != self.world_size:
            return f"{path} was written by a job of {m.world_size} ranks, this one has {self.world_size}"
        reason, _ = check_files(step_dir, m.files, full=True)
        return f"{step_dir}: {reason}" if reason else ""

    def _named_step(self, resume: str) -> str:
        """The step rlsup named, checked on every rank: each rank's own part for per-rank backends (a node
        may hold only its own ranks' parts), the whole step for collective ones. Raises
        :class:`ResumeError` naming every rank that cannot load it."""
        step_dir = Path(resume)
        if self.backend.collective:
            problem = "" if self.rank != 0 else (verify_step_dir(step_dir, full=True).reason or "")
        else:
            problem = self._own_part_problem(step_dir)
        failed = _failed_ranks(not problem)
        if problem:
            raise ResumeError(f"rank {self.rank} cannot load the step rlsup named ({resume}): {problem}")
        if failed:
            raise ResumeError(f"rank(s) {failed} cannot load the step rlsup named ({resume}); see their errors")
        return resume

    def restore(self, state: dict[str, Any]) -> int:
        """Load the chosen checkpoint into ``state`` in place; returns its step, 0 when none."""
        with section("load"):
            self.rank, self.world_size = _rank_world()
            dist = _dist()
            resume = self._rlsup_resume()
            chosen_path: str | None = None
            if resume is not None:
                # rlsup chose across all nodes and tiers: that step, or (empty) a fresh start; never another.
                chosen_path = self._named_step(resume) if resume else None
            elif dist is not None:
                # Rank 0 verifies once and tells the others, so all ranks load the same step.
                box: list[Any] = [None]
                if self.rank == 0:
                    chosen = self.choose()
                    box[0] = None if chosen is None else str(chosen.path)
                dist.broadcast_object_list(box, src=0)
                chosen_path = box[0]
            else:
                chosen = self.choose()
                chosen_path = None if chosen is None else str(chosen.path)
            if chosen_path is None:
                log.info("no valid checkpoint under %s: starting fresh", self.directory)
                return 0
            step_dir = Path(chosen_path)
            first = read_manifest(step_dir / manifest_name(self.rank))
            backend = self.backend if first.backend == self.backend.name else get_backend(first.backend)
            ctx = LoadContext(step_dir, self.rank, self.world_size, first.world_size, dist is not None,
                              self.safe_globals, dict(state))
            payload = backend.load(ctx)
            for name in list(state):
                if name not in payload:
                    log.warning("checkpoint %s has no entry %r; left as is", step_dir.name, name)
                    continue
                obj = state[name]
                if callable(getattr(obj, "load_state_dict", None)):
                    obj.load_state_dict(payload[name])
                else:
                    state[name] = payload[name]
            rng = payload.get(RNG_KEY)
            if rng is not None:
                restore_rng_state(rng)  # last: loading objects above may draw random numbers
            named = os.environ.get(ENV_RESUME_STEP)
            if resume and named and named.isdigit() and int(named) != first.step:
                raise ResumeError(f"rlsup named step {named} but {step_dir} holds step {first.step}")
            log.info("restored %s (rank %d)", step_dir.name, self.rank)
            return first.step
