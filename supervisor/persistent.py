"""A persistent checkpoint tier: verified copies of rlsup-layout steps on a shared filesystem (or fsspec URL).

Node-local disks and peer replicas die with the allocation; a copy on a shared filesystem (Lustre,
GPFS, NFS) or an object store outlives it. :class:`PersistentTier` copies the newest valid local step
whenever the cadence says so (``every_n`` steps since the last copy, ``every_seconds`` since the last
copy; either one when both are set; every new valid step when neither is), in a background thread
(:meth:`start`) or on demand (:meth:`poll`).

The same rule as everywhere in rlsup: a copy has its final name only once it verifies.

* Filesystem destination: the files listed in the source's manifests are copied (fsynced) into
  ``<dest>/.incoming-step_N-<pid>-<token>/step_N/``, the manifests last; the copy is verified with
  :func:`rlsup_format.manifest.verify_step_dir` (``full=True``: every checksum); only then is it
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
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import xxhash

from supervisor.parts import Part, owner_of, verify_part
from rlsup_format.manifest import (
    CHUNK_SIZE,
    MANIFEST_RE,
    STEP_DIR_RE,
    FileEntry,
    ManifestError,
    RankManifest,
    fsync_dir,
    latest_valid,
    list_step_dirs,
    manifest_name,
    step_dir_name,
    verify_step_dir,
)

log = logging.getLogger(__name__)

HOLD_NAME = ".hold-persistent"
INCOMING_PREFIX = ".incoming-"
DELETING_PREFIX = ".deleting-"
STALE_AGE_S = 3600.0
# Multi-node (per-part) mode: temp files inside the tier's step dirs are named
# ``.part-<host>-<pid>-<token>``; the host tells a later pass whether the pid can be checked here.
PART_TMP_PREFIX = ".part-"
CLEAN_EVERY_S = 60.0


class PersistentTierError(RuntimeError):
    """A copy to or from the persistent tier failed or did not verify."""


class PersistentPartInvalid(PersistentTierError):
    """A part in the persistent tier is missing, torn, or does not match its manifest.

    Distinct from an I/O error on this node (a full local disk): a caller may safely stop offering
    this part, whereas an I/O error says nothing about the copy in the tier."""


@dataclass(frozen=True)
class TierCopy:
    """A step that verified in the persistent tier."""

    step: int
    location: str
    size_bytes: int


def _pid_alive(pid: int) -> bool:
    if pid <= 0:  # no pid in the name: unknown owner, only age makes it stale (and kill(-1, 0) means "all")
        return True
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


def _open_step_file(src: Path) -> Any:
    """``src``, a file of a step directory, opened for reading without following a symlink anywhere
    below that step directory (its nearest ``step_N`` ancestor; else just the file itself), and only
    if it is a regular file: a symlinked shard would otherwise be copied as whatever it points at and
    the copy would verify. UnsafeFileError (an OSError) otherwise."""
    from rlsup_format.manifest import open_nofollow

    base = next((p for p in src.parents if STEP_DIR_RE.match(p.name)), src.parent)
    return os.fdopen(open_nofollow(base, src.relative_to(base).as_posix()), "rb")


def _copy_local_file(src: Path, dst: Path, limiter: Any) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with _open_step_file(src) as fin, open(dst, "wb") as fout:
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
        with _open_step_file(path) as f:  # a symlinked manifest is refused, never followed
            raw = f.read()
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


def _hold_name() -> str:
    """``.hold-persistent-<host>-<pid>``: the host tells whose pid it is when the checkpoint dir is shared."""
    return f"{HOLD_NAME}-{socket.gethostname()}-{os.getpid()}"


def clear_stale_holds(checkpoint_dir: Path) -> list[Path]:
    """Remove this host's holds whose process is gone (an rlsup SIGKILLed mid-copy): retention skips
    held steps, so a stale hold would keep its step on disk forever. Holds of other hosts are left."""
    removed = []
    host = socket.gethostname()
    try:
        steps = [e.path for e in os.scandir(checkpoint_dir) if STEP_DIR_RE.match(e.name) and e.is_dir()]
    except OSError:
        return removed
    for step_dir in steps:
        try:
            names = [n for n in os.listdir(step_dir) if n.startswith(HOLD_NAME + "-")]
        except OSError:
            continue
        for name in names:
            who, _, pid = name[len(HOLD_NAME) + 1:].rpartition("-")
            if pid.isdigit() and who in (host, "") and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                try:
                    os.unlink(os.path.join(step_dir, name))
                    removed.append(Path(step_dir, name))
                except OSError:
                    pass
    return removed


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
        # Credentials and endpoint come from the environment: the protocol's own (for s3fs, botocore
        # reads AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...) and fsspec's
        # FSSPEC_<PROTOCOL>_<KWARG> (e.g. FSSPEC_S3_ENDPOINT_URL). No listings cache: other processes
        # (another node's retention, an operator) change the store, and a stale listing would give
        # stale sizes and ETags (s3fs reads with If-Match: the cached ETag, so a replaced object fails).
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, use_listings_cache=False)
        except TypeError:  # a filesystem that takes no such option
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
        manifest_bytes = 0  # counted in the size, as verify_step_dir does for a directory
        for rank, name in sorted(found.items()):
            try:
                raw = self.fs.cat_file(f"{base}/{name}")
                m = RankManifest.from_json(raw)
            except (ManifestError, OSError) as e:
                return False, f"torn manifest: {name}: {e}", 0
            if m.rank != rank:
                return False, f"torn manifest: {name} says rank {m.rank}", 0
            manifests[rank] = m
            manifest_bytes += len(raw)
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
        total = manifest_bytes
        for name, entry in seen.items():
            try:
                size = self.fs.size(f"{base}/{name}")
            except FileNotFoundError:
                return False, f"{name}: missing", total
            if size != entry.size:
                return False, f"{name}: size {size} != {entry.size}", total
            try:
                digest = self._hash(f"{base}/{name}", limiter) if full else entry
            except OSError as e:  # deleted or replaced while read (S3: 404, 412 on If-Match)
                return False, f"{name}: unreadable: {e}", total
            if digest != entry:
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
        try:
            self.fs.rm(base, recursive=True)
        except FileNotFoundError:  # an object store has no directories: nothing left is nothing to do
            pass


# ------------------------------------------------------------------------------------- per-part access
#
# Multi-node runs write each rank's part (manifest + files) from the node that owns it, several nodes
# into one step directory at once, so the whole-step rename above cannot be used. These adapters give
# PersistentTier the few per-file operations the per-part protocol needs, for either store; they never
# decide anything (what to copy, what to keep) themselves.


def _host_tag() -> str:
    """This machine's name, safe inside a temp file name (no '-', which separates the fields)."""
    import socket

    return "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:40] or "host"


def _part_tmp_owner(name: str) -> tuple[str, int] | None:
    """(host, pid) of a ``.part-<host>-<pid>-<token>`` temp name, or None for any other name."""
    if not name.startswith(PART_TMP_PREFIX):
        return None
    fields = name[len(PART_TMP_PREFIX):].split("-")
    if len(fields) != 3 or not fields[1].isdigit():
        return None
    return fields[0], int(fields[1])


class _LocalParts:
    """Per-file access to a :class:`_LocalStore`: data files through temp + fsync + read back + rename."""

    def __init__(self, store: _LocalStore) -> None:
        self.store = store
        self.host = _host_tag()

    def _p(self, step: int, rel: str) -> Path:
        return self.store.path(step) / rel

    def names(self, step: int) -> list[str]:
        try:
            return sorted(os.listdir(self.store.path(step)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def read(self, step: int, rel: str) -> bytes:
        return self._p(step, rel).read_bytes()

    def size(self, step: int, rel: str) -> int | None:
        try:
            st = os.stat(self._p(step, rel), follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size

    def hash(self, step: int, rel: str, limiter: Any) -> FileEntry:
        return _hash_path(self._p(step, rel), limiter)

    def open(self, step: int, rel: str) -> Any:
        return open(self._p(step, rel), "rb")

    def _tmp_beside(self, final: Path) -> Path:
        return final.parent / f"{PART_TMP_PREFIX}{self.host}-{os.getpid()}-{secrets.token_hex(4)}"

    def put_file(self, step: int, rel: str, src: Path, entry: FileEntry, limiter: Any) -> None:
        """Copy under a temp name, read it back, and give it its final name only if it matches."""
        final = self._p(step, rel)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp_beside(final)
        try:
            _copy_local_file(src, tmp, limiter)
            got = _hash_path(tmp, limiter)
            if got != entry:
                raise PersistentTierError(f"{self.store.location}: {rel} of step {step} reads back as "
                                          f"{got.size} bytes {got.xxh3_128}, expected {entry.size} {entry.xxh3_128}")
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(final.parent)

    def put_manifest(self, step: int, name: str, raw: bytes) -> None:
        """The commit of a part: temp, fsync, rename, directory fsync (as trainer_hooks writes manifests)."""
        final = self._p(step, name)
        tmp = self._tmp_beside(final)
        try:
            with open(tmp, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(final.parent)

    def remove(self, step: int, rel: str) -> None:
        self._p(step, rel).unlink(missing_ok=True)
        fsync_dir(self.store.path(step))

    def clean(self) -> None:
        """Remove temp files of killed copies: this host's dead pids at once, any host's after STALE_AGE_S
        (a live copy keeps its temp file's mtime fresh; another host's pid cannot be checked from here)."""
        now = time.time()
        try:
            top = list(os.scandir(self.store.root))
        except OSError:
            top = []
        for e in top:  # steps a killed node 0 was deleting: out of the step namespace, doomed anyway
            if e.name.startswith(DELETING_PREFIX) and f"-{os.getpid()}-" not in e.name:
                _remove_tree(Path(e.path))
        for step in self.store.steps():
            for dirpath, _dirs, files in os.walk(self.store.path(step)):
                for name in files:
                    owner = _part_tmp_owner(name)
                    if owner is None:
                        continue
                    path = Path(dirpath) / name
                    try:
                        age = now - path.stat(follow_symlinks=False).st_mtime
                    except OSError:
                        continue
                    host, pid = owner
                    dead_here = host == self.host and pid != os.getpid() and not _pid_alive(pid)
                    if dead_here or age > STALE_AGE_S:
                        path.unlink(missing_ok=True)


class _NullSink:
    """A write target that discards: hashing a file reuses the (rate-limited) copy loop."""

    def write(self, chunk: bytes) -> int:
        return len(chunk)


def _hash_path(path: Path, limiter: Any) -> FileEntry:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        n = _copy_stream(f, _NullSink(), limiter, h)
    return FileEntry(n, h.hexdigest())


class _FsspecParts:
    """Per-file access to an :class:`_FsspecStore`. No rename: an object is written in one put, read
    back and hashed; the manifest put last is the part's commit. A killed upload leaves data objects
    without a manifest, which never counts."""

    def __init__(self, store: _FsspecStore) -> None:
        self.store = store
        self.fs = store.fs

    def _p(self, step: int, rel: str) -> str:
        return f"{self.store.path(step)}/{rel}"

    def names(self, step: int) -> list[str]:
        base = self.store.path(step)
        try:
            try:
                entries = self.fs.ls(base, detail=False, refresh=True)
            except TypeError:  # filesystems without refresh=
                entries = self.fs.ls(base, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(n.rstrip("/").rsplit("/", 1)[-1] for n in entries)

    def read(self, step: int, rel: str) -> bytes:
        return self.fs.cat_file(self._p(step, rel))

    def size(self, step: int, rel: str) -> int | None:
        try:
            return int(self.fs.size(self._p(step, rel)))
        except FileNotFoundError:
            return None

    def hash(self, step: int, rel: str, limiter: Any) -> FileEntry:
        return self.store._hash(self._p(step, rel), limiter)

    def open(self, step: int, rel: str) -> Any:
        return self.fs.open(self._p(step, rel), "rb")

    def put_file(self, step: int, rel: str, src: Path, entry: FileEntry, limiter: Any) -> None:
        path = self._p(step, rel)
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with open(src, "rb") as fin, self.fs.open(path, "wb") as fout:
            _copy_stream(fin, fout, limiter)
        got = self.hash(step, rel, limiter)
        if got != entry:
            raise PersistentTierError(f"{self.store.location}: {rel} of step {step} does not match after upload")

    def put_manifest(self, step: int, name: str, raw: bytes) -> None:
        path = self._p(step, name)
        self.fs.pipe_file(path, raw)
        if self.fs.cat_file(path) != raw:
            raise PersistentTierError(f"{self.store.location}: {name} of step {step} does not read back")

    def remove(self, step: int, rel: str) -> None:
        try:
            self.fs.rm(self._p(step, rel))
        except FileNotFoundError:
            pass

    def clean(self) -> None:
        pass  # nothing is renamed, so there are no temp objects; half-written parts have no manifest


# ------------------------------------------------------------------------------------- the tier


class PersistentTier:
    """Copies valid local steps to ``url_or_path`` and fetches them back; see the module docstring."""

    def __init__(self, url_or_path: str | os.PathLike, every_n: int | None = None, every_seconds: float | None = None,
                 keep_last: int | None = None, bandwidth: float = 0, source: str | os.PathLike | None = None,
                 clock: Callable[[], float] = time.monotonic, node: int | None = None) -> None:
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
        self._final = False  # flush(): the last copy ignores the cadence
        self.copies = 0
        self.bytes_copied = 0
        self.last_error: str | None = None
        # Multi-node (per-part) mode when ``node`` is set: see :meth:`poll_parts`.
        self.node = node
        self.parts: Any = _FsspecParts(self.store) if isinstance(self.store, _FsspecStore) else _LocalParts(self.store)
        self._done_parts: set[tuple[int, int]] = set()  # (step, rank) known valid in the tier
        self._protected: set[int] = set()  # steps a restore is using: retention leaves them alone
        self._last_clean: float | None = None

    @classmethod
    def from_config(cls, cfg: Any, node: int | None = None, job: str = "") -> "PersistentTier | None":
        """From a SupervisorConfig (persistent_* keys); None when ``persistent_dir`` is empty.
        ``node``: this node's rank in a multi-node run (per-part mode), None for a single node.
        ``job``: the job's identity; its copies live under ``<persistent_dir>/<job>/``, so jobs that
        share a persistent_dir never see each other's steps."""
        target = getattr(cfg, "persistent_dir", "") or ""
        if not target:
            return None
        if job:
            target = target.rstrip("/") + "/" + job
        return cls(target, every_n=getattr(cfg, "persistent_every", 0) or None,
                   every_seconds=getattr(cfg, "persistent_every_seconds", 0.0) or None,
                   keep_last=getattr(cfg, "persistent_keep_last", 0) or None,
                   bandwidth=getattr(cfg, "persistent_bandwidth", 0.0) or 0.0,
                   source=getattr(cfg, "checkpoint_dir", None), node=node)

    # ---------------------------------------------------------------- copying out

    def _due(self, step: int) -> bool:
        if self._final or (self.every_n is None and self.every_seconds is None):
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
        for hold in clear_stale_holds(src_root):
            log.info("removed the stale hold %s (its rlsup is gone)", hold)
        if self.node is not None:
            return self.poll_parts(src_root)
        with self._lock:
            self.store.clean_leftovers()
            if self._last_step is None:  # continue the cadence from the newest copy that is whole
                existing = [s for s in self.store.steps() if self.store.verify(s, False)[0]]
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
            hold = newest.path / _hold_name()
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

    def flush(self, timeout: float) -> int | None:
        """The job ended (finished, stopped, preempted): stop the thread, then copy the newest valid step
        whatever the cadence says, so the run's last checkpoint outlives the allocation. Waits at most
        ``timeout`` seconds; a copy cut off by rlsup's exit is never valid (temp names, manifest last)
        and is cleaned by the next pass. On several nodes node 0 starts the step and the others join
        only if they see it started, so there the final copy is best effort."""
        self.stop(timeout)
        self._final = True
        result: list[int | None] = []

        def final() -> None:
            try:
                result.append(self.poll())
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
            _clean_dir(Path(dest_dir))  # the temp copy of a fetch whose rlsup was killed
            try:
                return self.store.get(step, Path(dest_dir), self.limiter)
            except (OSError, ManifestError) as e:
                raise PersistentTierError(f"fetching step {step} from {self.location} failed: {e}") from e

    # ---------------------------------------------------------------- multi-node: one part per rank

    def poll_parts(self, source: str | os.PathLike) -> int | None:
        """Multi-node copy-out: copy this node's own valid parts of the steps being persisted.

        Which steps: node 0 *starts* a step (its newest own part, when the cadence says so); every node
        *joins* the steps started in the tier that are not older than the newest complete one, copying
        the parts it owns and still holds locally. No other node decides on its own, so nodes with
        different clocks or restart histories still complete the same steps. Returns the newest step
        this pass copied (or found already valid) a part of, or None."""
        assert self.node is not None
        with self._lock:
            self._maybe_clean()
            steps = self.store.steps()
            if self._last_step is None and steps:
                self._last_step = steps[-1]  # a restarted node 0 continues the cadence, not restarts it
            floor = self._newest_complete(steps)
            own = self._own_local_parts(Path(source), floor)
            wanted = {s for s in steps if s in own and (floor is None or s >= floor)}
            started = None
            if self.node == 0 and own:
                newest = max(own)
                if newest not in steps and (self._last_step is None or newest > self._last_step) \
                        and self._due(newest):
                    started = newest
                    wanted.add(newest)
            copied = None
            for step in sorted(wanted, reverse=True):
                for part in own[step]:
                    if (step, part.rank) in self._done_parts or self._copy_part(part):
                        copied = step if copied is None else max(copied, step)
            if started is not None and all((started, p.rank) in self._done_parts for p in own[started]):
                self._last_step, self._last_time = started, self._clock()
            if self.node == 0:
                self._retain_parts()
            return copied

    def _maybe_clean(self) -> None:
        """Temp files of killed copies, at most every CLEAN_EVERY_S (it walks every step directory)."""
        now = time.monotonic()
        if self._last_clean is None or now - self._last_clean >= CLEAN_EVERY_S:
            self._last_clean = now
            self.parts.clean()

    def _newest_complete(self, steps: list[int]) -> int | None:
        """Newest step whose manifests of ranks 0..W-1 are all present (names only: cheap)."""
        for step in reversed(steps):
            ranks = {int(m.group(1)) for n in self.parts.names(step) if (m := MANIFEST_RE.match(n))}
            if not ranks:
                continue
            try:
                world = RankManifest.from_json(self.parts.read(step, manifest_name(min(ranks)))).world_size
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
                m = MANIFEST_RE.match(name)
                part = verify_part(step_dir, int(m.group(1)), full=False) if m else None
                if part is not None and part.step == step and part.owner in (self.node, None):
                    out.setdefault(step, []).append(part)
        return out

    def _tier_part_state(self, step: int, rank: int, full: bool = True) -> str:
        """"valid", "missing" or "invalid" for the part of ``rank`` in the tier's ``step``.

        Only a definite answer counts as invalid (torn manifest, missing or mismatching file); any
        other read error propagates, so a flaky read never makes a node replace a valid part."""
        try:
            raw = self.parts.read(step, manifest_name(rank))
        except FileNotFoundError:
            return "missing"
        try:
            m = RankManifest.from_json(raw)
        except ManifestError:
            return "invalid"
        if (m.rank, m.step) != (rank, step):
            return "invalid"
        for rel, entry in m.files.items():
            if self.parts.size(step, rel) != entry.size:
                return "invalid"
            if full:
                try:
                    got = self.parts.hash(step, rel, self.limiter)
                except FileNotFoundError:
                    return "invalid"
                if got != entry:
                    return "invalid"
        return "valid"

    def _check_no_conflict(self, step: int, rank: int, files: dict[str, FileEntry]) -> None:
        """Refuse to write a file that another rank's manifest in the tier lists with other contents:
        that would break another node's part (and the step could never verify anyway)."""
        for name in self.parts.names(step):
            m = MANIFEST_RE.match(name)
            if m is None or int(m.group(1)) == rank:
                continue
            try:
                other = RankManifest.from_json(self.parts.read(step, name))
            except (FileNotFoundError, ManifestError):
                continue
            for rel, entry in files.items():
                if rel in other.files and other.files[rel] != entry:
                    raise PersistentTierError(f"{rel} is listed by {name} with other contents; "
                                              "not overwriting another node's part")

    def _copy_part(self, part: Part) -> bool:
        """Copy one own part into the tier: data files first (each verified by reading it back), the
        manifest last, so the part counts only once whole. A valid part already there is kept; an
        invalid one of ours loses its manifest first, then is rewritten."""
        step, rank = part.step, part.rank
        hold = part.step_dir / _hold_name()
        try:
            hold.touch()
        except OSError:
            return False  # deleted under us
        t0 = time.monotonic()
        try:
            fresh = verify_part(part.step_dir, rank, full=True)
            if fresh is None or fresh.step != step:
                return False  # changed or corrupted since the scan: never persist a bad part
            raw = fresh.manifest_path.read_bytes()
            state = self._tier_part_state(step, rank)
            if state == "valid":
                self._done_parts.add((step, rank))
                return True
            if state == "invalid":
                log.warning("persistent step %d: rank %d's part does not verify; rewriting it", step, rank)
                self.parts.remove(step, manifest_name(rank))
            self._check_no_conflict(step, rank, fresh.manifest.files)
            for rel, entry in sorted(fresh.manifest.files.items()):
                if self.parts.size(step, rel) == entry.size and self.parts.hash(step, rel, self.limiter) == entry:
                    continue  # a file several ranks list, or left by an earlier try: already right
                self.parts.put_file(step, rel, fresh.step_dir / rel, entry, self.limiter)
            self.parts.put_manifest(step, manifest_name(rank), raw)
            if self._tier_part_state(step, rank, full=False) != "valid":
                raise PersistentTierError(f"rank {rank}'s part does not verify after the copy")
        except (OSError, ManifestError, PersistentTierError) as e:
            self.last_error = f"step {step} rank {rank}: {e}"
            log.warning("persistent copy of step %d rank %d to %s failed: %s", step, rank, self.location, e)
            return False
        finally:
            hold.unlink(missing_ok=True)
        self._done_parts.add((step, rank))
        self.copies += 1
        self.bytes_copied += fresh.size
        self.last_error = None
        log.info("step %d rank %d copied to the persistent tier %s in %.1fs", step, rank, self.location,
                 time.monotonic() - t0)
        return True

    def _retain_parts(self) -> None:
        """Node 0's retention in multi-node mode: whole steps older than the newest ``keep_last`` valid
        ones (sizes checked), never a protected step; so never the newest valid one, and never a step
        newer than it that other nodes may still be completing."""
        if self.keep_last is None:
            return
        steps = self.store.steps()
        kept, boundary = 0, None
        for step in reversed(steps):
            if self.store.verify(step, False)[0]:
                kept += 1
                if kept == self.keep_last:
                    boundary = step
                    break
        if boundary is None:
            return
        for step in steps:
            if step >= boundary:
                break
            if step in self._protected:
                continue
            log.info("persistent tier retention removes step %d", step)
            self.store.delete(step)
            self._done_parts = {d for d in self._done_parts if d[0] != step}

    def protect(self, step: int | None) -> None:
        """Keep ``step`` from retention (the step a restore is using); replaces the previous one."""
        self._protected = set() if step is None else {step}

    def part_listing(self, newer_than: int | None = None,
                     exclude: set[tuple[int, int]] | frozenset[tuple[int, int]] = frozenset()) -> dict[int, dict[str, Any]]:
        """Parts offered for a multi-node restore: ``{step: {"world_size": W, "ranks": [...], "owners":
        {rank: node}}}`` (owners as the manifests record them; ranks without one are left out there).

        Cheap: manifests read and file sizes checked, no checksums (the fetching node verifies in
        full). Newest first, down to ``newer_than`` (exclusive) or the first step whose every rank is
        offered, since nothing older could then be chosen. ``exclude``: (step, rank) known bad."""
        out: dict[int, dict[str, Any]] = {}
        for step in reversed(self.store.steps()):
            if newer_than is not None and step <= newer_than:
                break
            ranks, worlds, owners = [], set(), {}
            for name in self.parts.names(step):
                m = MANIFEST_RE.match(name)
                if m is None or (step, int(m.group(1))) in exclude:
                    continue
                rank = int(m.group(1))
                try:
                    man = RankManifest.from_json(self.parts.read(step, name))
                except (FileNotFoundError, ManifestError):
                    continue
                if (man.rank, man.step) != (rank, step):
                    continue
                if any(self.parts.size(step, rel) != e.size for rel, e in man.files.items()):
                    continue
                ranks.append(rank)
                worlds.add(man.world_size)
                if (owner := owner_of(man)) is not None:
                    owners[rank] = owner
            if len(worlds) != 1:
                continue
            (world,) = worlds
            out[step] = {"world_size": world, "ranks": sorted(ranks), "owners": owners}
            if sorted(ranks) == list(range(world)):
                break
        return out

    def fetch_part(self, step: int, rank: int, dest_dir: str | os.PathLike) -> Path:
        """Copy ``rank``'s part of ``step`` into ``dest_dir/step_N`` and return that step directory.

        Files go to a staging directory (trainer_hooks' ``.staging-rank_R-<pid>`` name, so a trainer
        cleans it up if we are killed), each is checked against the manifest while read and hashed
        again on disk; they get their final names only then, the manifest last. A valid local part is
        kept. Raises :class:`PersistentPartInvalid` when the tier's part is missing, torn or does not
        match, :class:`PersistentTierError` for other failures."""
        step_dir = Path(dest_dir) / step_dir_name(step)
        have = verify_part(step_dir, rank, full=True)
        if have is not None and have.step == step:
            return step_dir
        mname = manifest_name(rank)
        try:
            raw = self.parts.read(step, mname)
        except FileNotFoundError as e:
            raise PersistentPartInvalid(f"step {step} rank {rank}: no manifest in {self.location}") from e
        except OSError as e:
            raise PersistentTierError(f"step {step} rank {rank}: reading {self.location}: {e}") from e
        try:
            man = RankManifest.from_json(raw)
        except ManifestError as e:
            raise PersistentPartInvalid(f"step {step} rank {rank}: torn manifest in {self.location}: {e}") from e
        if (man.rank, man.step) != (rank, step):
            raise PersistentPartInvalid(f"step {step} rank {rank}: manifest says step {man.step} rank {man.rank}")
        try:
            self._fetch_part_files(step, rank, man, raw, step_dir)
        except PersistentTierError:
            raise
        except OSError as e:
            raise PersistentTierError(f"fetching step {step} rank {rank} from {self.location} failed: {e}") from e
        if verify_part(step_dir, rank, full=False) is None:
            raise PersistentTierError(f"step {step} rank {rank}: fetched part does not verify")
        self._done_parts.add((step, rank))  # just read in full: the tier's copy is good
        return step_dir

    def _fetch_part_files(self, step: int, rank: int, man: RankManifest, raw: bytes, step_dir: Path) -> None:
        step_dir.mkdir(parents=True, exist_ok=True)
        (step_dir / manifest_name(rank)).unlink(missing_ok=True)  # an invalid local part: manifest first
        staging = step_dir / f".staging-rank_{rank:05d}-{os.getpid()}"
        _remove_tree(staging)
        staging.mkdir()
        try:
            for rel, entry in sorted(man.files.items()):
                tmp = staging / rel
                tmp.parent.mkdir(parents=True, exist_ok=True)
                try:
                    src = self.parts.open(step, rel)
                except FileNotFoundError as e:
                    raise PersistentPartInvalid(f"step {step} rank {rank}: {rel} missing in {self.location}") from e
                h = xxhash.xxh3_128()
                with src, open(tmp, "wb") as fout:
                    n = _copy_stream(src, fout, self.limiter, h)
                    fout.flush()
                    os.fsync(fout.fileno())
                if FileEntry(n, h.hexdigest()) != entry:
                    raise PersistentPartInvalid(f"step {step} rank {rank}: {rel} in {self.location} does not "
                                                f"match its manifest ({n} bytes, expected {entry.size})")
                if _hash_path(tmp, None) != entry:  # what landed on this disk, before it gets its name
                    raise PersistentTierError(f"step {step} rank {rank}: {rel} differs after writing it locally")
            dirs = {step_dir}
            for rel in sorted(man.files):
                final = step_dir / rel
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(staging / rel, final)
                dirs.add(final.parent)
            for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
                fsync_dir(d)
            tmp_manifest = staging / manifest_name(rank)
            with open(tmp_manifest, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_manifest, step_dir / manifest_name(rank))  # last: the part is valid only now
            fsync_dir(step_dir)
        finally:
            _remove_tree(staging)


def iter_candidates(tier: PersistentTier, newer_than: int | None) -> Iterator[int]:
    """Persistent steps newer than ``newer_than``, newest first (names only; verified on fetch)."""
    for step in reversed(tier.steps()):
        if newer_than is not None and step <= newer_than:
            return
        yield step
