"""A persistent checkpoint tier: verified copies of rlsup-layout steps on a shared filesystem (or fsspec URL).

Node-local disks and peer replicas die with the allocation; a copy on a shared filesystem (Lustre,
GPFS, NFS) or an object store outlives it. :class:`PersistentTier` copies the newest valid local step
whenever the cadence says so (``every_n`` steps since the last copy, ``every_seconds`` since the last
copy; either one when both are set; every new valid step when neither is), in a background thread
(:meth:`start`) or on demand (:meth:`poll`).

The same rule as everywhere in rlsup: a copy has its final name only once it verifies.

* Filesystem destination: the files listed in the source's manifests are copied (fsynced) into
  ``<dest>/.incoming-step_N-<pid>-<token>/step_N/``, the manifests last; the copy is verified with
  :func:`trainer_hooks.manifest.verify_step_dir` (``full=True``: every checksum); only then is it
  renamed to ``<dest>/step_N``. An invalid old copy of the same step is moved aside first; a valid one
  is never rewritten. While copying, the source step carries a ``.hold-persistent-<pid>`` marker, so
  the trainer's ``keep_last`` does not delete it under the copy.
* fsspec URL (``s3://``, ``gs://``, ``memory://`` ..., needs ``fsspec`` and the protocol's package,
  e.g. ``s3fs``): an object store has no atomic directory rename, so the rlsup protocol itself is the
  commit: data objects first, read back and checked against the manifests, then the manifests; a step
  without all its manifests, or whose objects do not match them, is invalid. Deletion removes the
  manifests first, so a half-deleted step never looks valid.

Retention (``keep_last``): after a successful copy, keeps the newest ``keep_last`` valid copies and
deletes older ones (and invalid copies older than the newest valid one); it never deletes the copy it
just verified, which is the newest. :meth:`latest_valid` verifies every checksum, so a corrupted copy
is never offered; :meth:`fetch` copies a step back into a local checkpoint directory with the same
verify-then-rename rule. ``bandwidth`` (bytes/s, 0 = unlimited) caps reads and writes together
(token bucket: :class:`supervisor.transport.client.BandwidthLimiter`).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import xxhash

from trainer_hooks.manifest import (
    CHUNK_SIZE,
    MANIFEST_RE,
    STEP_DIR_RE,
    FileEntry,
    ManifestError,
    RankManifest,
    fsync_dir,
    latest_valid,
    manifest_name,
    step_dir_name,
    verify_step_dir,
)

log = logging.getLogger(__name__)

HOLD_NAME = ".hold-persistent"
INCOMING_PREFIX = ".incoming-"
DELETING_PREFIX = ".deleting-"
STALE_AGE_S = 3600.0


class PersistentTierError(RuntimeError):
    """A copy to or from the persistent tier failed or did not verify."""


@dataclass(frozen=True)
class TierCopy:
    """A step that verified in the persistent tier."""

    step: int
    location: str
    size_bytes: int


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _limiter(bandwidth: float) -> Any:
    if not bandwidth:
        return None
    from supervisor.transport.client import BandwidthLimiter

    return BandwidthLimiter(bandwidth)


def _copy_stream(src: Any, dst: Any, limiter: Any, hasher: Any = None) -> int:
    n = 0
    while True:
        chunk = src.read(CHUNK_SIZE)
        if not chunk:
            return n
        if limiter is not None:
            limiter.consume(len(chunk))
        if hasher is not None:
            hasher.update(chunk)
        dst.write(chunk)
        n += len(chunk)


def _copy_local_file(src: Path, dst: Path, limiter: Any) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        _copy_stream(fin, fout, limiter)
        fout.flush()
        os.fsync(fout.fileno())


def _source_manifests(step_dir: Path) -> tuple[list[tuple[str, bytes]], dict[str, FileEntry]]:
    """The manifests (name, bytes) of ranks 0..W-1 and the union of the files they list."""
    first = None
    manifests: list[tuple[str, bytes]] = []
    files: dict[str, FileEntry] = {}
    rank = 0
    while True:
        path = step_dir / manifest_name(rank)
        raw = path.read_bytes()
        m = RankManifest.from_json(raw)
        first = first or m
        manifests.append((path.name, raw))
        files.update(m.files)
        rank += 1
        if rank >= first.world_size:
            return manifests, files


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------- stores


class _LocalStore:
    """A directory on a (shared) filesystem."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)
        self.location = str(self.root)

    def steps(self) -> list[int]:
        try:
            entries = list(os.scandir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(int(m.group(1)) for e in entries if (m := STEP_DIR_RE.match(e.name)) and e.is_dir())

    def path(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def verify(self, step: int, full: bool) -> tuple[bool, str, int]:
        r = verify_step_dir(self.path(step), full=full)
        return r.valid, r.reason, r.size_bytes

    def clean_leftovers(self) -> None:
        _clean_dir(self.root)

    def put(self, step: int, source: Path, limiter: Any) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        _copy_verified_into(source, self.root, step, limiter, final)

    def get(self, step: int, dest_dir: Path, limiter: Any) -> Path:
        return _copy_verified_into(self.path(step), dest_dir, step, limiter, dest_dir / step_dir_name(step))

    def delete(self, step: int) -> None:
        path = self.path(step)
        doomed = self.root / f"{DELETING_PREFIX}{path.name}-{os.getpid()}-{secrets.token_hex(3)}"
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return
        fsync_dir(self.root)
        _remove_tree(doomed)


def _clean_dir(root: Path) -> None:
    """Remove temp copies and half-deleted steps of dead (or long gone) processes."""
    now = time.time()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for e in entries:
        if not e.name.startswith((INCOMING_PREFIX, DELETING_PREFIX)):
            continue
        parts = e.name.rsplit("-", 2)
        pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else -1
        try:
            age = now - e.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        if pid == os.getpid() and age < STALE_AGE_S:
            continue
        if not _pid_alive(pid) or age > STALE_AGE_S:
            _remove_tree(Path(e.path))


def _copy_verified_into(source: Path, dest_root: Path, step: int, limiter: Any, final: Path) -> Path:
    """Copy the step at ``source`` to ``final`` (in ``dest_root``): temp dir, manifests last, full
    verification, then rename. A valid ``final`` is kept as is; an invalid one is replaced."""
    manifests, files = _source_manifests(source)
    dest_root.mkdir(parents=True, exist_ok=True)
    tmp_root = dest_root / f"{INCOMING_PREFIX}{step_dir_name(step)}-{os.getpid()}-{secrets.token_hex(3)}"
    tmp = tmp_root / step_dir_name(step)
    tmp.mkdir(parents=True)
    try:
        dirs = {tmp}
        for rel in sorted(files):
            _copy_local_file(source / rel, tmp / rel, limiter)
            dirs.add((tmp / rel).parent)
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            fsync_dir(d)
        for name, raw in manifests:  # last, as the trainer writes them
            with open(tmp / name, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
        fsync_dir(tmp)
        return _publish_verified(tmp, dest_root, final, f"copy of step {step} from {source}")
    finally:
        _remove_tree(tmp_root)


def _publish_verified(tmp: Path, dest_root: Path, final: Path, what: str) -> Path:
    """Verify ``tmp`` in full, then rename it to ``final`` (a valid ``final`` is kept, an invalid one
    moved aside and removed)."""
    result = verify_step_dir(tmp, full=True)
    if not result.valid:
        raise PersistentTierError(f"{what} does not verify: {result.reason}")
    if final.exists():
        if verify_step_dir(final, full=True).valid:
            return final  # a valid copy is never rewritten
        aside = dest_root / f"{DELETING_PREFIX}{final.name}-{os.getpid()}-{secrets.token_hex(3)}"
        os.rename(final, aside)
        _remove_tree(aside)
    os.rename(tmp, final)
    fsync_dir(dest_root)
    return final


class _FsspecStore:
    """An fsspec URL. The manifests-last protocol is the commit (object stores cannot rename)."""

    def __init__(self, url: str) -> None:
        try:
            import fsspec
        except ImportError as e:
            raise ImportError(f"persistent tier {url!r} needs fsspec (and the protocol's package, "
                              "e.g. s3fs for s3://): pip install fsspec s3fs") from e
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.root = self.root.rstrip("/")
        self.location = url

    def path(self, step: int) -> str:
        return f"{self.root}/{step_dir_name(step)}"

    def steps(self) -> list[int]:
        try:
            names = self.fs.ls(self.root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        except TypeError:  # filesystems without refresh=
            names = self.fs.ls(self.root, detail=False)
        out = set()
        for n in names:
            m = STEP_DIR_RE.match(n.rstrip("/").rsplit("/", 1)[-1])
            if m:
                out.add(int(m.group(1)))
        return sorted(out)

    def _hash(self, path: str, limiter: Any) -> FileEntry:
        h = xxhash.xxh3_128()
        with self.fs.open(path, "rb") as f:
            n = 0
            while True:
                chunk = f.read(CHUNK_SIZE)
                if not chunk:
                    break
                if limiter is not None:
                    limiter.consume(len(chunk))
                h.update(chunk)
                n += len(chunk)
        return FileEntry(n, h.hexdigest())

    def verify(self, step: int, full: bool, limiter: Any = None) -> tuple[bool, str, int]:
        """The checks of :func:`verify_step_dir`, over the store."""
        base = self.path(step)
        try:
            names = [n.rstrip("/").rsplit("/", 1)[-1] for n in self.fs.ls(base, detail=False)]
        except FileNotFoundError:
            return False, "directory missing", 0
        found = {int(m.group(1)): n for n in names if (m := MANIFEST_RE.match(n))}
        if not found:
            return False, "no manifests", 0
        manifests = {}
        for rank, name in sorted(found.items()):
            try:
                m = RankManifest.from_json(self.fs.cat_file(f"{base}/{name}"))
            except (ManifestError, OSError) as e:
                return False, f"torn manifest: {name}: {e}", 0
            if m.rank != rank:
                return False, f"torn manifest: {name} says rank {m.rank}", 0
            manifests[rank] = m
        first = manifests[min(manifests)]
        if any((m.world_size, m.step, m.backend) != (first.world_size, first.step, first.backend)
               for m in manifests.values()):
            return False, "manifests disagree", 0
        if first.step != step:
            return False, f"manifest step {first.step} != directory step {step}", 0
        if sorted(manifests) != list(range(first.world_size)):
            return False, "rank manifests missing or extra", 0
        seen: dict[str, FileEntry] = {}
        for m in manifests.values():
            for name, entry in m.files.items():
                if seen.setdefault(name, entry) != entry:
                    return False, f"{name}: listed by several ranks with different contents", 0
        total = 0
        for name, entry in seen.items():
            try:
                size = self.fs.size(f"{base}/{name}")
            except FileNotFoundError:
                return False, f"{name}: missing", total
            if size != entry.size:
                return False, f"{name}: size {size} != {entry.size}", total
            if full and self._hash(f"{base}/{name}", limiter) != entry:
                return False, f"checksum mismatch in {name}", total
            total += entry.size
        return True, "ok", total

    def clean_leftovers(self) -> None:
        pass  # nothing is renamed; an unfinished upload is an invalid step, replaced by the next copy

    def put(self, step: int, source: Path, limiter: Any) -> None:
        manifests, files = _source_manifests(source)
        base = self.path(step)
        if self.fs.exists(base):
            if self.verify(step, full=True)[0]:
                return
            self.delete(step)
        for rel in sorted(files):
            self.fs.makedirs(f"{base}/{rel}".rsplit("/", 1)[0], exist_ok=True)
            with open(source / rel, "rb") as fin, self.fs.open(f"{base}/{rel}", "wb") as fout:
                _copy_stream(fin, fout, limiter)
        for rel, entry in files.items():  # read back before the manifests make the step valid
            if self._hash(f"{base}/{rel}", limiter) != entry:
                raise PersistentTierError(f"{self.location}: {rel} of step {step} does not match after upload")
        for name, raw in manifests:
            self.fs.pipe_file(f"{base}/{name}", raw)
        ok, reason, _ = self.verify(step, full=False)
        if not ok:
            raise PersistentTierError(f"{self.location}: step {step} does not verify after upload: {reason}")

    def get(self, step: int, dest_dir: Path, limiter: Any) -> Path:
        base = self.path(step)
        dest_dir.mkdir(parents=True, exist_ok=True)
        final = dest_dir / step_dir_name(step)
        tmp_root = dest_dir / f"{INCOMING_PREFIX}{step_dir_name(step)}-{os.getpid()}-{secrets.token_hex(3)}"
        src_tmp = tmp_root / "src" / step_dir_name(step)
        src_tmp.mkdir(parents=True)
        try:
            names = [n.rstrip("/").rsplit("/", 1)[-1] for n in self.fs.ls(base, detail=False)]
            manifest_names = [n for n in names if MANIFEST_RE.match(n)]
            files: dict[str, FileEntry] = {}
            for name in manifest_names:
                raw = self.fs.cat_file(f"{base}/{name}")
                (src_tmp / name).write_bytes(raw)
                files.update(RankManifest.from_json(raw).files)
            for rel in sorted(files):
                (src_tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                with self.fs.open(f"{base}/{rel}", "rb") as fin, open(src_tmp / rel, "wb") as fout:
                    _copy_stream(fin, fout, limiter)
                    fout.flush()
                    os.fsync(fout.fileno())
            fsync_dir(src_tmp)
            return _publish_verified(src_tmp, dest_dir, final, f"step {step} fetched from {self.location}")
        finally:
            _remove_tree(tmp_root)

    def delete(self, step: int) -> None:
        base = self.path(step)
        try:
            names = self.fs.ls(base, detail=False)
        except FileNotFoundError:
            return
        for n in names:  # manifests first: a half-deleted step is never valid
            if MANIFEST_RE.match(n.rstrip("/").rsplit("/", 1)[-1]):
                self.fs.rm(n)
        self.fs.rm(base, recursive=True)


# ------------------------------------------------------------------------------------- the tier


class PersistentTier:
    """Copies valid local steps to ``url_or_path`` and fetches them back; see the module docstring."""

    def __init__(self, url_or_path: str | os.PathLike, every_n: int | None = None, every_seconds: float | None = None,
                 keep_last: int | None = None, bandwidth: float = 0, source: str | os.PathLike | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError("persistent keep_last must be >= 1 (or None/0 to keep everything)")
        target = str(url_or_path)
        if "://" in target and not target.startswith("file://"):
            self.store: Any = _FsspecStore(target)
        else:
            self.store = _LocalStore(target.removeprefix("file://"))
        self.location = self.store.location
        self.every_n = every_n or None
        self.every_seconds = every_seconds or None
        self.keep_last = keep_last or None
        self.bandwidth = float(bandwidth or 0)
        self.limiter = _limiter(self.bandwidth)
        self.source = Path(source) if source is not None else None
        self._clock = clock
        self._last_step: int | None = None
        self._last_time: float | None = None
        self._done: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.copies = 0
        self.bytes_copied = 0
        self.last_error: str | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> "PersistentTier | None":
        """From a SupervisorConfig (persistent_* keys); None when ``persistent_dir`` is empty."""
        target = getattr(cfg, "persistent_dir", "") or ""
        if not target:
            return None
        return cls(target, every_n=getattr(cfg, "persistent_every", 0) or None,
                   every_seconds=getattr(cfg, "persistent_every_seconds", 0.0) or None,
                   keep_last=getattr(cfg, "persistent_keep_last", 0) or None,
                   bandwidth=getattr(cfg, "persistent_bandwidth", 0.0) or 0.0,
                   source=getattr(cfg, "checkpoint_dir", None))

    # ---------------------------------------------------------------- copying out

    def _due(self, step: int) -> bool:
        if self.every_n is None and self.every_seconds is None:
            return True
        if self._last_step is None:
            return True
        by_steps = self.every_n is not None and step - self._last_step >= self.every_n
        by_time = self.every_seconds is not None and (
            self._last_time is None or self._clock() - self._last_time >= self.every_seconds)
        return by_steps or by_time

    def poll(self, source: str | os.PathLike | None = None) -> int | None:
        """Copy the newest valid local step if the cadence says so; returns the step copied, or None."""
        src_root = Path(source) if source is not None else self.source
        if src_root is None:
            raise ValueError("no source checkpoint directory: pass source= to PersistentTier or poll()")
        with self._lock:
            self.store.clean_leftovers()
            if self._last_step is None:
                existing = self.store.steps()
                if existing:
                    self._last_step = existing[-1]
                    self._done.update(existing)
            newest = latest_valid(src_root, full=False)  # sizes; the copy is verified in full
            if newest is None or newest.step is None:
                return None
            step = newest.step
            if step in self._done or (self._last_step is not None and step <= self._last_step):
                return None
            if not self._due(step):
                return None
            hold = newest.path / f"{HOLD_NAME}-{os.getpid()}"
            try:
                hold.touch()
            except OSError:
                return None  # deleted under us (retention): the next poll sees the next step
            t0 = time.monotonic()
            try:
                if not verify_step_dir(newest.path, full=False).valid:
                    return None
                self.store.put(step, newest.path, self.limiter)
            except (OSError, ManifestError, PersistentTierError) as e:
                self.last_error = f"step {step}: {e}"
                log.warning("persistent copy of step %d to %s failed: %s", step, self.location, e)
                return None
            finally:
                try:
                    hold.unlink()
                except FileNotFoundError:
                    pass
            self._done.add(step)
            self._last_step, self._last_time = step, self._clock()
            self.copies += 1
            self.bytes_copied += newest.size_bytes
            self.last_error = None
            log.info("step %d copied to the persistent tier %s in %.1fs", step, self.location, time.monotonic() - t0)
            self._retain(step)
            return step

    def _retain(self, newest_copied: int) -> None:
        if self.keep_last is None:
            return
        kept = 0
        newest_valid_seen = False
        for step in reversed(self.store.steps()):
            if step == newest_copied:  # just verified in full: always kept, always counts
                kept += 1
                newest_valid_seen = True
                continue
            if step > newest_copied:
                continue
            valid = self.store.verify(step, full=False)[0]
            if valid and kept < self.keep_last:
                kept += 1
                newest_valid_seen = True
                continue
            if not newest_valid_seen:
                continue
            log.info("persistent tier retention removes step %d", step)
            self.store.delete(step)
            self._done.discard(step)

    # ---------------------------------------------------------------- background thread

    def start(self, source: str | os.PathLike | None = None, interval: float = 5.0) -> None:
        """Poll every ``interval`` seconds in a daemon thread until :meth:`stop`."""
        if source is not None:
            self.source = Path(source)
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.poll()
                except Exception as e:  # noqa: BLE001 - the tier must never kill the supervisor
                    self.last_error = str(e)
                    log.exception("persistent tier poll failed")
                self._stop.wait(interval)

        self._thread = threading.Thread(target=loop, name="rlsup-persistent-tier", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop the thread after its current copy (a copy in progress is finished, not torn)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # ---------------------------------------------------------------- reading back

    def steps(self) -> list[int]:
        """Steps present in the tier (valid or not), oldest first."""
        return self.store.steps()

    def verify(self, step: int, full: bool = True) -> bool:
        return self.store.verify(step, full)[0]

    def latest_valid(self) -> TierCopy | None:
        """The newest step whose copy verifies in full (every checksum), or None."""
        for step in reversed(self.store.steps()):
            ok, _, size = self.store.verify(step, True)
            if ok:
                return TierCopy(step, str(self.store.path(step)), size)
        return None

    def fetch(self, step: int, dest_dir: str | os.PathLike) -> Path:
        """Copy ``step`` into ``dest_dir/step_N`` (temp, verified in full, renamed); returns that path.

        A valid local copy already there is kept. Raises PersistentTierError when the persistent copy
        does not verify (it is never renamed into place)."""
        with self._lock:
            try:
                return self.store.get(step, Path(dest_dir), self.limiter)
            except (OSError, ManifestError) as e:
                raise PersistentTierError(f"fetching step {step} from {self.location} failed: {e}") from e


def iter_candidates(tier: PersistentTier, newer_than: int | None) -> Iterator[int]:
    """Persistent steps newer than ``newer_than``, newest first (names only; verified on fetch)."""
    for step in reversed(tier.steps()):
        if newer_than is not None and step <= newer_than:
            return
        yield step
