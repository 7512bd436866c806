"""Keep the newest complete versions of a single-file checkpoint aside; put one back when a save was cut.

A trainer that saves ``ckpt.pt`` with ``torch.save`` over the old one (nanoGPT and many scripts)
truncates its only checkpoint when the save begins: killed mid-write, the file is torn and every
restart crash-loops. So while the job runs, a background pass notices each new complete version
(its format checked by :func:`supervisor.layouts.single_file.check_file`) and keeps it in
``<checkpoint_dir>/.rlsup-versions/`` (same filesystem; a dot name that globs and "newest file"
scans skip). Before a restart :meth:`FileVersions.restore` puts the newest kept version back where
the live file is torn or missing. A kill at any byte of a save then costs one save interval at most.

A version is a hard link when the trainer is seen to write a new inode per save (write to a temp
file, then rename: the old inode is never written again), else a copy: a link to a file rewritten
in place would be torn with it. A copy is kept only when the live file did not change while it was
copied and the copy itself checks complete. The newest kept version is never removed.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlsup_format.fileio import fsync_dir, fsync_file
from supervisor.layouts import detect_layout, single_file
from supervisor.poll_loop import PollLoop

if TYPE_CHECKING:
    from supervisor.config import SupervisorConfig

log = logging.getLogger(__name__)
PASS_INTERVAL_S = 0.5
_SEP = "--"  # <mtime_ns, 20 digits>--<path relative to checkpoint_dir, / as %2F>


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


class FileVersions:
    """The kept versions of one checkpoint directory's single-file checkpoints."""

    def __init__(self, root: Path, settings: FileVersionSettings) -> None:
        self.root = root
        self.settings = settings
        self.store = root / single_file.VERSIONS_DIR
        self.kept = 0  # versions kept by this process: the progress rule compares it across an attempt
        self._seen: dict[Path, tuple[int, int, int]] = {}  # live file -> (ino, size, mtime_ns) last kept
        self._new_inodes: dict[Path, bool] = {}  # live file -> the trainer writes a new inode per save
        self._lock = threading.Lock()  # the background pass and the run loop's own pass never overlap
        self._loop = PollLoop(self.observe, "rlsup-file-versions", lambda e: None)

    @classmethod
    def from_config(cls, cfg: "SupervisorConfig", root: Path) -> "FileVersions | None":
        settings = FileVersionSettings.from_config(cfg)
        return None if settings is None else cls(root, settings)

    # ------------------------------------------------------------ which files

    def tracked(self) -> list[Path]:
        """The live checkpoint files now (auto: only while no other layout recognises the directory)."""
        if not self.root.is_dir():
            return []
        if self.settings.auto and detect_layout(self.root) != "unknown":
            return []
        return single_file.tracked_files(self.root, self.settings.pattern)

    def newest_valid(self) -> Path | None:
        """The newest complete live file (what a restart resumes from), or None."""
        valid = [p for p in self.tracked() if single_file.check_file(p).ok]
        return max(valid, key=_mtime, default=None)

    # ------------------------------------------------------------ keeping

    def start(self) -> None:
        self._loop.start(PASS_INTERVAL_S)

    def stop(self) -> None:
        self._loop.stop(timeout=30.0)

    def observe(self) -> int:
        """One pass: keep each live file's new complete version; the number kept."""
        with self._lock:
            return sum(self._keep(live) for live in self.tracked())

    def _keep(self, live: Path) -> bool:
        try:
            before = os.stat(live)
        except OSError:
            return False
        key = (before.st_ino, before.st_size, before.st_mtime_ns)
        if self._seen.get(live) == key or not single_file.check_file(live).ok:
            return False
        previous = self._seen.get(live)
        if previous is not None and previous[0] != key[0]:
            self._new_inodes[live] = True  # a save made a new file: linking never shares a rewritten inode
        self.store.mkdir(exist_ok=True)
        name = f"{before.st_mtime_ns:020d}{_SEP}{self._rel(live)}"
        tmp = self.store / f".tmp-{os.getpid()}-{name}"
        try:
            self._materialise(live, tmp, link=self._new_inodes.get(live, False))
            after = os.stat(live)
            if (after.st_ino, after.st_size, after.st_mtime_ns) != key or not single_file.check_file(tmp).ok:
                tmp.unlink(missing_ok=True)  # the trainer saved again while we copied: the next pass keeps it
                return False
            os.replace(tmp, self.store / name)  # a kept version appears whole or not at all
            fsync_dir(self.store)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.warning("single-file checkpoint %s: version not kept (%s)", live, e)
            return False
        self._seen[live] = key
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
        """Kept versions (of ``live``, or all), newest first."""
        out = []
        try:
            entries = list(self.store.iterdir())
        except OSError:
            return []
        for path in entries:
            mtime, sep, rel = path.name.partition(_SEP)
            if not sep or not mtime.isdigit() or path.name.startswith("."):
                continue
            owner = self.root / rel.replace("%2F", "/")
            if live is not None and owner != live:
                continue
            try:
                size = path.stat().st_size
            except OSError:
                continue
            out.append(KeptVersion(path, owner, int(mtime), size))
        return sorted(out, key=lambda v: v.mtime_ns, reverse=True)

    def _prune(self, live: Path) -> None:
        """Keep the newest ``keep`` versions of ``live`` within ``max_bytes`` (all files' versions
        together); the newest version of each file always stays."""
        for old in self.versions(live)[self.settings.keep:]:
            old.path.unlink(missing_ok=True)
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
        """Before a launch: every live file that is torn or missing gets its newest kept version back
        (a copy, written beside it and renamed over it). Never touches a complete live file."""
        with self._lock:
            return self._restore()

    def _restore(self) -> list[Restored]:
        done = []
        for live in sorted({v.live for v in self.versions()}):
            check = single_file.check_file(live)
            if check.ok:
                continue
            version = self.versions(live)[0]
            tmp = live.parent / f".rlsup-restore-{os.getpid()}-{live.name}"
            try:
                self._materialise(version.path, tmp, link=False)
                os.replace(tmp, live)
                fsync_dir(live.parent)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                log.error("single-file checkpoint %s is %s, and the kept version %s could not be put back: %s",
                          live, check.reason, version.path, e)
                continue
            self._seen[live] = _key(live)
            done.append(Restored(live, version, check.reason))
        return done

    def _rel(self, live: Path) -> str:
        try:
            return str(live.relative_to(self.root)).replace("/", "%2F")
        except ValueError:
            return live.name


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _key(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns
