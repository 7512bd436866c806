"""Atomic, verified checkpoints from inside every training rank, and exact restore.

:class:`CheckpointManager` is the user-facing object: it knows the directory, the backend and
``keep_last``, and decides what to load. How a step is written (staging directory, fsync, hash,
rename, manifest last, retention) is one protocol in :mod:`trainer_hooks.step_writer`, run here for
a synchronous save and by the writer process for an asynchronous one, so both leave the same bytes.

A step is valid only when all ranks' manifests are present and every listed file checks out
(:mod:`rlsup_format.manifest`); anything else is ignored by restore and by the supervisor.

Never losing data: a step that is already fully valid is never touched, and a rank whose own part of
the step already verifies does not rewrite it (for collective backends the ranks decide together).
Retention (``keep_last``) runs on rank 0 only once the new step verifies complete, and never deletes
the newest valid step, a held step (hold marker) or the step named by ``RLSUP_RESUME_DIR``.

Another world size (a job shrunk or grown): a step marked resizable at save time (:mod:`trainer_hooks.world`)
restores into any number of ranks; :attr:`CheckpointManager.world_change` then says from how many.

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

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from rlsup_format import job_env
from rlsup_format.manifest import (
    ManifestError,
    RankManifest,
    VerifyResult,
    check_files,
    latest_valid,
    manifest_name,
    read_manifest,
    verify_step_dir,
)
from trainer_hooks.backends import get_backend
from trainer_hooks.backends.base import RNG_KEY, LoadContext
from trainer_hooks.heartbeat import section, should_stop
from trainer_hooks.memory_tier import MemoryTarget
from trainer_hooks.rng import reseed_rng, restore_rng_state
from trainer_hooks.step_writer import (  # the error classes are imported from here
    CheckpointConflictError,
    CheckpointSpaceError,
    RankIdentity,
    StepTarget,
    build_payload,
    disk_full_error,
    dist_group,
    failed_ranks,
    wait_for_removals,
    write_step,
)
from trainer_hooks.world import WorldChange, WorldChangeError, previous_world_size, resize_blockers, world_change_seed

log = logging.getLogger(__name__)

# What users import from here; the errors are defined with the write protocol, the RLSUP_* names in rlsup_format.job_env.
# The environment names trainers imported from here before rlsup_format.job_env became their home: kept, so that
# their code goes on working (the values are job_env's, never spelled again).
ENV_DIR = job_env.CHECKPOINT_DIR
ENV_JOB = job_env.JOB_ID
ENV_RESUME = job_env.RESUME_DIR
ENV_RESUME_STEP = job_env.RESUME_STEP

__all__ = ["CheckpointManager", "CheckpointConflictError", "CheckpointSpaceError", "ResumeError", "WorldChange",
           "WorldChangeError", "disk_full_error", "ENV_DIR", "ENV_JOB", "ENV_RESUME", "ENV_RESUME_STEP"]


class ResumeError(RuntimeError):
    """rlsup named a step to resume from (``RLSUP_RESUME_DIR``) and it cannot be loaded here. The
    attempt fails loudly instead of quietly starting over: a rank that started fresh while its peers
    resumed, or every rank starting fresh after rlsup said "from step N", would lose the run's progress."""


class CheckpointManager:
    """Save and restore a dict of stateful objects and plain values, atomically and verifiably."""

    def __init__(self, directory: str | os.PathLike | None = None, keep_last: int | None = None,
                 backend: str = "torch", safe_globals: tuple | list = (), async_save: bool = False,
                 max_in_flight: int = 1, when_busy: str = "wait", keep_buffers: bool = True,
                 direct_save: bool = True, resizable: bool | None = None) -> None:
        """``async_save=True``: :meth:`save` returns once the state is copied; a writer process writes
        it (:mod:`trainer_hooks.async_writer`). At most ``max_in_flight`` saves are in flight; a save
        beyond that waits (``when_busy="wait"``) or is skipped and returns None (``"skip"``).
        ``keep_buffers`` keeps the snapshot buffers (pinned with CUDA) for the next save. ``direct_save``:
        an async save into rlsup's memory tier builds each file in a ready spare (:mod:`trainer_hooks.direct_save`);
        False: ``torch.save`` writes it (the old way, a benchmark's baseline). ``resizable``: None marks each
        save as restorable into another world size when :func:`trainer_hooks.world.resize_blockers` finds
        nothing against it; True marks every save and lets :meth:`restore` move an unmarked step (you vouch
        that its state is replicated); False never marks."""
        directory = directory if directory is not None else os.environ.get(job_env.CHECKPOINT_DIR)
        if not directory:
            raise ValueError(f"no checkpoint directory: pass directory= or set {job_env.CHECKPOINT_DIR}")
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be >= 1 (or None to keep everything)")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.backend_name = backend
        self.backend = get_backend(backend)
        self.safe_globals = tuple(safe_globals)
        who = RankIdentity.current()
        self.rank, self.world_size = who.rank, who.world_size
        self.resizable = resizable
        #: Set by :meth:`restore`: the step came from another world size (None: same world, or a fresh start).
        self.world_change: WorldChange | None = None
        self._async: Any = None
        self._said_collective = False
        self._said_blockers = False
        if async_save:
            if self.backend.collective:
                raise NotImplementedError(
                    f"async_save=True is implemented for the 'torch' backend only; the {backend!r} backend's "
                    "save is a collective that every rank must run in the training process "
                    "(use async_save=False, or backend='torch')")
            from trainer_hooks.async_writer import AsyncSaver

            self._async = AsyncSaver(backend, max_in_flight, when_busy, keep_buffers, direct_save)

    # ----------------------------------------------------------------------------------- save

    def save(self, step: int, state: dict[str, Any]) -> Path | None:
        """Write ``state`` as step ``step`` (a collective for the dcp/megatron backends).

        With ``async_save=True`` it returns once the state is copied (the step becomes valid when the
        writer finishes; :meth:`wait` flushes), and None when the save was skipped (``when_busy="skip"``).
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        with section("save"):  # async: only the blocking part (a free slot and the copy)
            who = RankIdentity.current()
            self.rank, self.world_size = who.rank, who.world_size
            target = StepTarget(self.directory, self.keep_last, os.environ.get(job_env.RESUME_DIR) or None)
            memory = self._memory_tier()
            built: dict[str, Any] | None = None
            if memory is not None:  # node memory when the step fits there (all ranks agree), else disk
                built = build_payload(state)
                target = memory.choose(step, built, target)
            target = dataclasses.replace(target, resizable=self._marks_resizable(state))

            def make_payload() -> dict[str, Any]:
                return built if built is not None else build_payload(state)

            if self._async is not None:
                return self._async.save(target, step, make_payload, who, preempted=should_stop())
            return write_step(target, step, make_payload, who, self.backend, live=state)

    def _marks_resizable(self, state: dict[str, Any]) -> bool:
        """Whether this save's manifests say it may be restored into another world size (said once when not)."""
        if self.resizable is not None:
            return self.resizable
        blockers = resize_blockers(state, self.backend_name, self.world_size)
        if blockers and not self._said_blockers:
            log.info("checkpoints not marked resizable (rlsup will not shrink or grow this job): %s", "; ".join(blockers))
            self._said_blockers = True
        return not blockers

    def _memory_tier(self) -> MemoryTarget | None:
        """rlsup's memory tier for this manager's saves: only for the directory rlsup watches, and only
        for per-rank backends (a collective backend's files are shared by all ranks: disk)."""
        memory = MemoryTarget.from_env()
        watched = os.environ.get(job_env.CHECKPOINT_DIR)
        if memory is None or not watched or os.path.realpath(watched) != os.path.realpath(self.directory):
            return None
        if self.backend.collective:
            if not self._said_collective:
                log.warning("memory tier %s not used: the %r backend saves collectively; saving to %s",
                            memory.directory, self.backend_name, self.directory)
                self._said_collective = True
            return None
        return memory

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no save is in flight (True), or ``timeout`` seconds passed (False).

        Raises :class:`trainer_hooks.async_writer.AsyncSaveError` when a background save failed.
        Synchronous saves are never in flight, so then it returns True at once. The wait counts as
        saving for the hang detector (a ``save`` section): it is the end of a save, however long."""
        if self._async is None:
            return True
        with section("save"):
            return self._async.wait(timeout)

    def close(self) -> None:
        """Flush in-flight saves, finish retention's background removals and stop the writer process
        (also done at interpreter exit)."""
        if self._async is not None:
            self._async.close()
        wait_for_removals()

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
        resume = os.environ.get(job_env.RESUME_DIR)
        if resume is None:
            return None
        watched = os.environ.get(job_env.CHECKPOINT_DIR)
        mine = os.path.realpath(self.directory)
        if resume:
            parent = os.path.realpath(os.path.dirname(resume.rstrip("/")))
            memory = os.environ.get(job_env.MEMORY_DIR)
            in_memory = bool(memory and watched and os.path.realpath(watched) == mine
                             and parent == os.path.realpath(memory))  # rlsup's memory tier serves this dir
            return resume if parent == mine or in_memory else None
        return "" if watched and os.path.realpath(watched) == mine else None

    def _own_part_problem(self, step_dir: Path) -> str:
        """Why the part this rank reads from ``step_dir`` cannot be loaded ("" when it verifies: all a
        per-rank backend reads): its own, or rank 0's after a world change."""
        path = step_dir / manifest_name(self.rank)
        if not path.exists():
            path = step_dir / manifest_name(0)  # a rank the saving world did not have: rank 0's says which world
        try:
            m = read_manifest(path)
        except (ManifestError, OSError) as e:
            return f"{path} is missing or unreadable ({e.__class__.__name__}: {e})"
        if m.world_size != self.world_size:
            try:
                m = self._movable(step_dir, m)
            except (WorldChangeError, ManifestError, OSError) as e:
                return str(e)
        reason, _ = check_files(step_dir, m.files, full=True)
        return f"{step_dir}: {reason}" if reason else ""

    def _movable(self, step_dir: Path, seen: RankManifest) -> RankManifest:
        """Rank 0's manifest of a step saved by another world size, when that step may be restored here;
        else :class:`WorldChangeError` naming the step and both world sizes."""
        first = seen if seen.rank == 0 else read_manifest(step_dir / manifest_name(0))
        change = WorldChange(first.step, first.world_size, self.world_size)
        if first.resizable:
            return first
        if self.resizable:
            log.warning("%s is not marked resizable; restored into %d ranks because resizable=True", change,
                        self.world_size)
            return first
        raise WorldChangeError(
            f"step {first.step} ({step_dir}) was saved by {first.world_size} ranks and cannot be restored into "
            f"{self.world_size}: its save was not marked resizable (its state holds pieces trainer_hooks cannot "
            "move between world sizes; the save's log says which). Pass CheckpointManager(resizable=True) if the "
            "state is replicated on every rank")

    def _named_step(self, resume: str) -> str:
        """The step rlsup named, checked on every rank: each rank's own part for per-rank backends (a node
        may hold only its own ranks' parts), the whole step for collective ones. Raises
        :class:`ResumeError` naming every rank that cannot load it."""
        step_dir = Path(resume)
        if self.backend.collective:
            checked = verify_step_dir(step_dir, full=True) if self.rank == 0 else None
            problem = "" if checked is None or checked.valid else checked.reason
        else:
            problem = self._own_part_problem(step_dir)
        failed = failed_ranks(not problem, self.rank)
        if problem:
            raise ResumeError(f"rank {self.rank} cannot load the step rlsup named ({resume}): {problem}")
        if failed:
            raise ResumeError(f"rank(s) {failed} cannot load the step rlsup named ({resume}); see their errors")
        return resume

    def restore(self, state: dict[str, Any]) -> int:
        """Load the chosen checkpoint into ``state`` in place; returns its step, 0 when none.

        A step saved by another world size (marked resizable, or ``resizable=True``) is mapped onto this
        one (:mod:`trainer_hooks.world`): then :attr:`world_change` records both sizes, and the RNG is
        re-seeded by rule instead of restored. Else :class:`WorldChangeError` names the step and both sizes."""
        with section("load"):
            who = RankIdentity.current()
            self.rank, self.world_size = who.rank, who.world_size
            self.world_change = None
            dist = dist_group()
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
            own = step_dir / manifest_name(self.rank)
            first = read_manifest(own if own.exists() else step_dir / manifest_name(0))
            change: WorldChange | None = None
            if first.world_size != self.world_size:
                first = self._movable(step_dir, first)  # the same answer on every rank: rank 0's manifest
                change = WorldChange(first.step, first.world_size, self.world_size)
            self._check_rlsup_world(first.world_size)
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
            if change is not None:  # last: loading objects above may draw random numbers
                reseed_rng(world_change_seed(rng, first.step, self.rank))  # rank 0's streams are not this rank's
            elif rng is not None:
                restore_rng_state(rng)
            named = os.environ.get(job_env.RESUME_STEP)
            if resume and named and named.isdigit() and int(named) != first.step:
                raise ResumeError(f"rlsup named step {named} but {step_dir} holds step {first.step}")
            self.world_change = change
            if change is not None:
                log.warning("restored %s (rank %d) into another world size: %s; RNG re-seeded", step_dir.name,
                            self.rank, change)
            else:
                log.info("restored %s (rank %d)", step_dir.name, self.rank)
            return first.step

    def _check_rlsup_world(self, saved_world_size: int) -> None:
        """rlsup's word on the saving world size (``RLSUP_PREVIOUS_WORLD_SIZE``) against the manifest's: the
        manifest is what is loaded; a disagreement is logged, never acted on."""
        said = previous_world_size()
        if said is not None and said != saved_world_size:
            log.warning("rlsup says the resumed step was saved by %d ranks, its manifest says %d", said,
                        saved_world_size)
