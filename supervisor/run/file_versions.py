"""Keep the newest complete versions of a single-file checkpoint aside; put one back when a save was cut.

A trainer that saves ``ckpt.pt`` with ``torch.save`` over the old one (nanoGPT and many scripts)
truncates its only checkpoint when the save begins: killed mid-write, the file is torn and every
restart crash-loops. So while the job runs, a background pass notices each new complete version
(its format checked by :func:`supervisor.layouts.single_file.check_file`) and keeps it in
``<checkpoint_dir>/.rlsup-versions/`` (same filesystem; a dot name that globs and "newest file"
scans skip). Before a restart :meth:`FileVersions.restore` puts the newest complete kept version
back where the live file is torn (or, see there, missing). A kill at any byte of a save then costs
one save interval at most: the pass runs when a save closes the file (watchdog, inotify on Linux), and
every :data:`PASS_INTERVAL_S` for what an event can miss.

A version is a hard link when that save made a new inode (write to a temp file, then rename: the
old inode is never written again), else a copy: a link to a file rewritten in place would be torn
with it. A copy is kept only when the live file did not change while it was copied and the copy
itself checks complete; a version is checked again before it is put back. Each live file's newest
kept version is never removed.

The pass and a put-back run in a child forked for each (:class:`supervisor.bounded_calls.BoundedCalls`,
forked): on a checkpoint mount that stops answering mid-save, the pass stuck there is a child rlsup leaves
behind, never a thread of its own that would hold rlsup's exit in the kernel (state D) after it decided to
exit. Each call is abandoned once its child has moved no byte for :data:`CALL_DEADLINE_S`, and the run loop's
own calls (a restore, the check after an attempt) wait for the background pass only while it moves: a stuck
mount costs the run loop that long once, then its calls answer "nothing" at once until the mount answers.
While a pass finds nothing to keep (another layout reads the directory, no single file in it), the next one
runs when a watched save wakes it or :data:`IDLE_RECHECK_S` later, so rlsup does not fork twice a second for
nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote

from rlsup_format.fileio import fsync_dir, fsync_file
from rlsup_format.names import host_tag
from supervisor.bounded_calls import BoundedCalls
from supervisor.layouts import detect_layout, single_file
from supervisor.tiers.poll_loop import PollLoop

if TYPE_CHECKING:
    from supervisor.config import SupervisorConfig

log = logging.getLogger(__name__)
PASS_INTERVAL_S = 0.5
#: A call into the directory (a forked child) abandoned once it has read or written nothing for this long.
CALL_DEADLINE_S = 10.0
#: After a pass that found nothing to keep: the next one on a watched save, else this many seconds later.
IDLE_RECHECK_S = 5.0
_SEP = "--"  # <mtime_ns, 20 digits>--<path relative to checkpoint_dir, percent-encoded>


@dataclass(frozen=True)
class FileVersionSettings:
    """The single-file part of the config (keys ``checkpoint_file``, ``file_versions_keep``,
    ``file_versions_max_bytes``; ``checkpoint_layout`` auto or single-file)."""

    pattern: str = ""
    keep: int = 2
    max_bytes: int = 0
    auto: bool = True  # checkpoint_layout auto: only while no other layout recognises the directory

    @classmethod
    def from_config(cls, cfg: "SupervisorConfig") -> "FileVersionSettings | None":
        """None when single-file checkpoints are off (another layout named, or keep 0)."""
        if cfg.checkpoint_layout not in ("auto", single_file.NAME) or cfg.file_versions_keep <= 0:
            return None
        return cls(cfg.checkpoint_file, cfg.file_versions_keep, cfg.file_versions_max_bytes,
                   cfg.checkpoint_layout == "auto")


@dataclass(frozen=True)
class KeptVersion:
    """One complete version kept aside: where it is, which live file it is a version of, and when
    that file was saved."""

    path: Path
    live: Path
    mtime_ns: int
    size: int


@dataclass(frozen=True)
class Restored:
    """A live file that was torn or missing and got the newest kept version back."""

    live: Path
    version: KeptVersion
    why: str


@dataclass(frozen=True)
class LeftTorn:
    """A live file that is torn with no complete kept version to put back: what is wrong with it, and why
    no version is there (the log and the failed attempt's incident name both)."""

    live: Path
    why: str
    no_version: str


class FileVersions:
    """The kept versions of one checkpoint directory's single-file checkpoints."""

    def __init__(self, root: Path, settings: FileVersionSettings) -> None:
        self.root = root
        self.settings = settings
        self.store = root / single_file.VERSIONS_DIR
        self.kept = 0  # versions kept by this process: the progress rule compares it across an attempt
        self._seen: dict[Path, tuple[int, int, int]] = {}  # live file -> (ino, size, mtime_ns) last kept
        self._missed: dict[Path, str] = {}  # live file -> why its newest complete save was not kept
        self._lock = threading.Lock()  # the background pass and the run loop's own calls never overlap
        self._calls = BoundedCalls(f"single-file checkpoints in {root}", CALL_DEADLINE_S, forked=True,
                                   label="rlsup-file-versions")
        self._loop = PollLoop(self._background_pass, "rlsup-file-versions", lambda e: None)
        self._tracking = True  # whether the last pass found a file to keep (its child says)
        self._idle_since: float | None = None  # when the last pass found none (the parent's clock)
        self._woken = False  # a watched save since that pass
        self._wait_said = False  # the run loop went on without a call: said once until one answers again

    # ------------------------------------------------------------ which files

    def tracked(self) -> list[Path]:
        """The live checkpoint files now (auto: only while no other layout recognises the directory); read in
        a forked call (none while the directory does not answer)."""
        return self._run_loop_call(self._tracked, [], "listing")

    def _tracked(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        if self.settings.auto and detect_layout(self.root) != "unknown":
            return []
        return single_file.tracked_files(self.root, self.settings.pattern)

    def newest_valid(self) -> Path | None:
        """The newest complete live file (what a restart resumes from), or None."""
        valid = [p for p in self._tracked() if single_file.check_file(p).ok]
        return max(valid, key=_mtime, default=None)

    # ------------------------------------------------------------ keeping

    def start(self) -> None:
        """The pass every :data:`PASS_INTERVAL_S`, and at once when a tracked file is closed after a write or
        renamed into place (watchdog): a trainer that saves more often than a pass runs still has each version
        kept before it rewrites the file. A directory that does not exist yet is only polled."""
        watch = self.root if self._calls.call(self.root.is_dir, False) else None
        pattern = self.settings.pattern  # no pattern: top-level files only, so no watch on subdirectories
        try:
            self._loop.start(PASS_INTERVAL_S, watch=watch, wakes_on=self._a_save_ended,
                             recursive="/" in pattern or "**" in pattern)
        except OSError as e:  # no inotify instance or watch left (fs.inotify limits): the timer alone
            log.warning("single-file checkpoints in %s: not watched (%s); versions are kept every %gs", self.root,
                        e, PASS_INTERVAL_S)
            self._loop.start(PASS_INTERVAL_S)

    def _a_save_ended(self, path: str, kind: str) -> bool:
        if kind not in ("closed", "moved", "created"):
            return False
        try:
            rel = os.path.relpath(path, self.root)
        except ValueError:
            return False
        if not single_file.matches(rel, self.settings.pattern):
            return False
        self._woken = True
        return True

    def stop(self) -> None:
        self._loop.stop(timeout=30.0)

    def observe(self) -> int:
        """One pass (in a forked child): keep each live file's new complete version; the number kept. Never
        raises: a version that cannot be kept (no space, no permission) is logged, and the job goes on."""
        return self._run_loop_call(self._observe, 0, "keeping versions", _PASS_STATE)

    def _background_pass(self) -> int:
        """The loop's pass: as :meth:`observe`, skipped while the last one found nothing to keep and no watched
        save woke it since (up to :data:`IDLE_RECHECK_S`): decided here, from what that pass's child said, with
        no look at the directory from rlsup's own process."""
        if (not self._tracking and self._idle_since is not None and not self._woken
                and time.monotonic() - self._idle_since < IDLE_RECHECK_S):
            return 0
        self._woken = False
        with self._lock:
            kept = self._forked(self._observe, 0, _PASS_STATE)
        self._idle_since = None if self._tracking else time.monotonic()
        return kept

    def _observe(self) -> int:
        try:
            tracked = self._tracked()
            self._tracking = bool(tracked)
            return sum(self._keep(live) for live in tracked)
        except OSError as e:
            log.warning("single-file checkpoints in %s: no version kept (%s)", self.root, e)
            return 0

    def _forked(self, fn, default, keep: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
        """``fn()`` in a forked, bounded call (:attr:`_calls`); ``keep``: what it changes of this object."""
        try:
            return self._calls.call(fn, default, owner=self, keep=keep)
        except OSError as e:
            log.warning("single-file checkpoints in %s: %s failed (%s)", self.root, getattr(fn, "__name__", "a call"),
                        e)
            return default

    def _run_loop_call(self, fn, default, doing: str, keep: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
        """A call of the run loop's: it waits for the background pass while that pass moves (a copy of a large
        file), and goes on with ``default`` once it does not (a mount that stopped answering), said once."""
        while not self._lock.acquire(timeout=0.5):
            if self._calls.quiet_for() > CALL_DEADLINE_S + 2.0:
                if not self._wait_said:
                    self._wait_said = True
                    log.warning("single-file checkpoints in %s: the background pass has moved nothing for %.0fs "
                                "(the directory is slow or not answering); going on without %s", self.root,
                                self._calls.quiet_for(), doing)
                return default
        try:
            self._wait_said = False
            return self._forked(fn, default, keep)
        finally:
            self._lock.release()

    def _keep(self, live: Path) -> bool:
        try:
            before = os.stat(live)
        except OSError:
            return False
        key = (before.st_ino, before.st_size, before.st_mtime_ns)
        previous = self._seen.get(live)
        if previous == key or not single_file.check_file(live).ok:
            return False
        # A link only when this very save made a new file (temp file + rename): the inode it links is never
        # written again. After an in-place save, or the first time, a copy (a link would be torn with it).
        link = previous is not None and previous[0] != key[0]
        name = f"{before.st_mtime_ns:020d}{_SEP}{quote(self._rel(live), safe='')}"
        tmp = self.store / f".tmp-{host_tag()}-{os.getpid()}-{name}"
        try:
            self.store.mkdir(exist_ok=True)
            self._materialise(live, tmp, link=link)
            after = os.stat(live)
            if (after.st_ino, after.st_size, after.st_mtime_ns) != key or not single_file.check_file(tmp).ok:
                tmp.unlink(missing_ok=True)  # the trainer saved again while we copied: the next pass keeps it
                self._missed[live] = (f"the trainer saved it again while rlsup copied it ({before.st_size} bytes): "
                                      "saves closer together than a copy of it takes")
                return False
            os.replace(tmp, self.store / name)  # a kept version appears whole or not at all
            fsync_dir(self.store)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.warning("single-file checkpoint %s: version not kept (%s)", live, e)
            self._missed[live] = f"keeping a version failed: {e}"
            return False
        self._seen[live] = key
        self._missed.pop(live, None)
        self.kept += 1
        self._prune(live)
        return True

    @staticmethod
    def _materialise(live: Path, dest: Path, link: bool) -> None:
        if link:
            try:
                os.link(live, dest)
                return
            except OSError:
                pass  # another filesystem, or no links there: copy
        shutil.copyfile(live, dest)
        fsync_file(dest)

    def versions(self, live: Path | None = None) -> list[KeptVersion]:
        """Kept versions (of ``live``, or all), newest first. An entry whose name does not decode to a
        file this directory's pattern could track (``..``, an absolute path, a dot component) is ignored:
        restore never writes outside the checkpoint directory, whatever the store holds."""
        out = []
        try:
            entries = list(self.store.iterdir())
        except OSError:
            return []
        for path in entries:
            mtime, sep, encoded = path.name.partition(_SEP)
            rel = unquote(encoded)
            if not sep or not mtime.isdigit() or not single_file.matches(rel, self.settings.pattern):
                continue
            owner = self.root / rel
            if live is not None and owner != live:
                continue
            try:
                st = path.lstat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                out.append(KeptVersion(path, owner, int(mtime), st.st_size))
        return sorted(out, key=lambda v: v.mtime_ns, reverse=True)

    def _prune(self, live: Path) -> None:
        """Keep the newest ``keep`` versions of ``live``, drop the versions of files the trainer itself
        removed (``ckpt_{step}.pt`` rotation: their live file is gone while ``live`` was just saved), and
        stay within ``max_bytes`` (all versions together); each live file's newest version always stays."""
        for old in self.versions(live)[self.settings.keep:]:
            old.path.unlink(missing_ok=True)
        everything = self.versions()
        for v in everything:
            if v.live != live and not v.live.exists():
                v.path.unlink(missing_ok=True)
        if self.settings.max_bytes <= 0:
            return
        everything = self.versions()
        newest = {v.live: v for v in reversed(everything)}  # each file's newest (reversed: newest last wins)
        total = sum(v.size for v in everything)
        for v in reversed(everything):  # oldest first
            if total <= self.settings.max_bytes:
                break
            if newest.get(v.live) is not v:
                v.path.unlink(missing_ok=True)
                total -= v.size

    # ------------------------------------------------------------ putting back

    def restore(self) -> list[Restored]:
        """Before a launch: a live file that is torn gets its newest complete kept version back (a copy,
        written beside it and renamed over it). A missing file is put back only when this run saw it live
        and no complete checkpoint file is left (a save that deletes before it writes): a file the trainer
        removed itself, or one a user removed to start over, stays gone. A complete live file, or one that
        cannot be read just now (a filesystem error is not a torn save), is never touched."""
        return self._run_loop_call(self._restore, [], "putting back torn files", ("_seen",))

    def _restore(self) -> list[Restored]:
        if self.settings.auto and self.root.is_dir() and detect_layout(self.root) != "unknown":
            return []  # another layout reads the directory now: not ours to touch
        done = []
        complete_left = any(single_file.check_file(p).ok for p in self._tracked())
        for live in sorted({v.live for v in self.versions()}):
            why = self._torn(live, complete_left)
            if why is None:
                continue
            version = next((v for v in self.versions(live) if single_file.check_file(v.path).ok), None)
            if version is None:
                continue  # left torn: :meth:`left_torn` says why
            tmp = live.parent / f".rlsup-restore-{os.getpid()}-{live.name}"
            try:
                self._materialise(version.path, tmp, link=False)
                os.replace(tmp, live)
                fsync_dir(live.parent)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                log.error("single-file checkpoint %s is %s, and the kept version %s could not be put back: %s",
                          live, why, version.path, e)
                continue
            self._seen[live] = _key(live)
            complete_left = True
            done.append(Restored(live, version, why))
        return done

    def left_torn(self) -> list[LeftTorn]:
        """The live files that are torn with no complete kept version to put back (what :meth:`restore` has to
        leave as it is), each with why no version is there. Read only; in a forked child, as the pass."""
        return self._run_loop_call(self._left_torn, [], "checking for torn files")

    def _left_torn(self) -> list[LeftTorn]:
        if self.settings.auto and self.root.is_dir() and detect_layout(self.root) != "unknown":
            return []  # another layout reads the directory now: not ours
        tracked = self._tracked()
        complete_left = any(single_file.check_file(p).ok for p in tracked)
        out = []
        for live in sorted({v.live for v in self.versions()} | set(tracked)):
            why = self._torn(live, complete_left)
            kept = self.versions(live)
            if why is None or any(single_file.check_file(v.path).ok for v in kept):
                continue
            out.append(LeftTorn(live, why, self._no_version(live, kept)))
        return out

    def _no_version(self, live: Path, kept: list[KeptVersion]) -> str:
        """Why no complete version of ``live`` is kept, as far as this run saw."""
        if kept:
            return f"its {len(kept)} kept version(s) fail the check as well"
        if live in self._missed:
            return f"no complete version of it was kept: {self._missed[live]}"
        return ("no complete version of it was kept: rlsup never saw it complete in this run (torn before the "
                "run began, or mid-save each time rlsup looked)")

    def _torn(self, live: Path, complete_left: bool) -> str | None:
        """Why ``live`` needs its kept version back, or None."""
        try:
            st = live.lstat()
        except FileNotFoundError:
            if live in self._seen and not complete_left:
                return "missing"
            return None
        except OSError:
            return None  # unreadable now (EIO, EACCES): not evidence of a torn save
        if not stat.S_ISREG(st.st_mode):
            return None
        check = single_file.check_file(live)
        if check.ok or "unreadable" in check.reason:
            return None
        return check.reason

    def _rel(self, live: Path) -> str:
        try:
            return str(live.relative_to(self.root))
        except ValueError:
            return live.name


#: What a pass changes of a :class:`FileVersions` (copied back from its child).
_PASS_STATE = ("kept", "_seen", "_missed", "_tracking")


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _key(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns
