"""The on-disk checkpoint format: per-rank manifests, and the checks that say a step is complete.

Why manifests: a checkpoint directory that merely *exists* proves nothing. A rank killed mid-save,
a full disk or a flaky filesystem leaves files with the right names and the wrong bytes. Each rank
therefore writes, last of all, a small JSON manifest listing every file it wrote with its size and
xxh3-128 checksum. A step is valid only when the manifests of all ranks 0..W-1 are present, agree
with each other, and every listed file matches. Both the ranks (to pick a resume point) and the
supervisor (to decide where a restart resumes) use this module, so it only ever *reads* checkpoint
data and never raises on bad data: corruption is a normal, reported outcome.

Layout::

    <directory>/step_000000100/
        manifest.rank_00000.json   written last by rank 0 (atomic rename)
        manifest.rank_00001.json
        rank_00000.pt ...          files listed in the manifests (backend specific)
        .hold-replication          optional hold markers: retention never deletes the step
        .staging-rank_00001-4242/  a save in progress (or a killed one's leftovers)
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

SCHEMA_VERSION = 1
STEP_DIR_RE = re.compile(r"^step_(\d{9,})$")
MANIFEST_RE = re.compile(r"^manifest\.rank_(\d{5,})\.json$")
HOLD_PREFIX = ".hold-"
CHUNK_SIZE = 8 * 1024 * 1024
_HEX128_RE = re.compile(r"^[0-9a-f]{32}$")
_FIELDS = ("schema", "step", "world_size", "rank", "backend", "files", "created",
           "rlsup_version", "extra")
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: opening a FIFO planted where a file should be must not block; O_NOCTTY: nor grab a tty.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | _CLOEXEC
_SUBDIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC


class ManifestError(ValueError):
    """A manifest that cannot be trusted: bad JSON, wrong types, unsafe paths, unknown schema."""


class UnsafeFileError(OSError):
    """A checkpoint file (or a directory on its way) that is a symbolic link, or not a regular file:
    never followed, never read. ``strerror`` says which."""


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def manifest_name(rank: int) -> str:
    return f"manifest.rank_{rank:05d}.json"


def _rlsup_version() -> str:
    # Imported lazily: trainer_hooks/__init__ may import this module while it is half initialised.
    import trainer_hooks

    return str(getattr(trainer_hooks, "__version__", "unknown"))


@dataclass
class FileEntry:
    """Size and checksum of one checkpoint file, as its writer saw it."""

    size: int
    xxh3_128: str


@dataclass
class RankManifest:
    """What one rank wrote for one step. Written last, so its presence means the rank finished."""

    schema: int
    step: int
    world_size: int
    rank: int
    backend: str
    files: dict[str, FileEntry]
    created: float
    rlsup_version: str = field(default_factory=_rlsup_version)
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> RankManifest:
        """Parse and validate strictly: anything unexpected is a ManifestError naming the problem."""
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            raise ManifestError(f"invalid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ManifestError(f"manifest must be a JSON object, got {type(data).__name__}")
        missing = [k for k in _FIELDS if k not in data]
        if missing:
            raise ManifestError(f"missing field(s): {', '.join(missing)}")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise ManifestError(f"unknown field(s): {', '.join(unknown)}")
        schema = _int(data, "schema")
        if schema != SCHEMA_VERSION:
            raise ManifestError(f"unsupported schema {schema} (this rlsup reads {SCHEMA_VERSION})")
        step = _int(data, "step", minimum=0)
        world_size = _int(data, "world_size", minimum=1)
        rank = _int(data, "rank", minimum=0)
        if rank >= world_size:
            raise ManifestError(f"rank {rank} out of range for world_size {world_size}")
        backend = data["backend"]
        if not isinstance(backend, str) or not backend:
            raise ManifestError("field 'backend' must be a non-empty string")
        created = data["created"]
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
            raise ManifestError("field 'created' must be a finite number")
        version = data["rlsup_version"]
        if not isinstance(version, str):
            raise ManifestError("field 'rlsup_version' must be a string")
        extra = data["extra"]
        if not isinstance(extra, dict):
            raise ManifestError("field 'extra' must be an object")
        raw_files = data["files"]
        if not isinstance(raw_files, dict):
            raise ManifestError("field 'files' must be an object")
        files: dict[str, FileEntry] = {}
        for name, entry in raw_files.items():
            check_relative_path(name)
            if not isinstance(entry, dict) or set(entry) != {"size", "xxh3_128"}:
                raise ManifestError(f"file entry {name!r} must have exactly 'size' and 'xxh3_128'")
            size = entry["size"]
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ManifestError(f"file entry {name!r}: size must be a non-negative integer")
            digest = entry["xxh3_128"]
            if not isinstance(digest, str) or not _HEX128_RE.match(digest):
                raise ManifestError(f"file entry {name!r}: xxh3_128 must be 32 lowercase hex digits")
            files[name] = FileEntry(size, digest)
        return cls(schema, step, world_size, rank, backend, files, float(created), version, extra)


def _int(data: dict[str, Any], key: str, minimum: int | None = None) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestError(f"field {key!r} must be an integer, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ManifestError(f"field {key!r} must be >= {minimum}, got {value}")
    return value


def check_relative_path(name: object) -> None:
    """Refuse any file name that could point outside the step directory (or be read two ways)."""
    if not isinstance(name, str) or not name:
        raise ManifestError(f"file name must be a non-empty string, got {name!r}")
    if "\\" in name:
        raise ManifestError(f"file name {name!r} contains a backslash")
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise ManifestError(f"file name {name!r} is absolute")
    if any(ord(c) < 32 for c in name):
        raise ManifestError(f"file name {name!r} contains control characters")
    for part in name.split("/"):
        if part in ("", ".", ".."):
            raise ManifestError(f"file name {name!r} has an empty, '.' or '..' component")
    if MANIFEST_RE.match(name):
        raise ManifestError(f"file name {name!r} is a manifest, not a data file")


def open_checkpoint_file(base: str | os.PathLike, name: str) -> int:
    """A read-only fd (caller closes) of ``base/name`` that is a regular file reached without following
    any symbolic link below ``base`` (``name`` is '/'-separated, relative; ``base`` itself is opened
    as given). A checkpoint's data files and manifests are never symlinks: following one would verify,
    copy or load whatever it points at (another step's shard, a file outside the checkpoint dir).
    FileNotFoundError when absent, :class:`UnsafeFileError` for a symlink or a non-regular file."""
    parts = name.split("/")
    dfd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        for part in parts[:-1]:
            try:
                nfd = os.open(part, _SUBDIR_FLAGS, dir_fd=dfd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeFileError(e.errno, f"directory {part!r} on its path is a symbolic link "
                                                   "or not a directory (not followed)") from None
                raise
            os.close(dfd)
            dfd = nfd
        try:
            fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafeFileError(errno.ELOOP, "a symbolic link (not followed)") from None
            raise
    finally:
        os.close(dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeFileError(errno.EINVAL, "not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_checkpoint_file(base: str | os.PathLike, name: str) -> bytes:
    """The bytes of ``base/name``, opened as :func:`open_checkpoint_file` does (for manifests)."""
    with os.fdopen(open_checkpoint_file(base, name), "rb") as f:
        return f.read()


def hash_fd(fd: int) -> FileEntry:
    """Size and xxh3-128 of an open file from its current offset to its end, 8 MiB at a time."""
    h = xxhash.xxh3_128()
    size = 0
    buf = bytearray(CHUNK_SIZE)
    view = memoryview(buf)
    while True:
        n = os.readv(fd, [buf])
        if not n:
            break
        h.update(view[:n])
        size += n
    return FileEntry(size, h.hexdigest())


def hash_file(path: str | os.PathLike) -> FileEntry:
    """Size and xxh3-128 of a file, streamed so a 100 GB shard costs 8 MiB of memory."""
    h = xxhash.xxh3_128()
    size = 0
    buf = bytearray(CHUNK_SIZE)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
    return FileEntry(size, h.hexdigest())


def fsync_dir(path: str | os.PathLike) -> None:
    """Make renames/creations inside ``path`` durable (a rename is only safe once its dir is synced)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(step_dir: str | os.PathLike, manifest: RankManifest) -> Path:
    """Publish a rank's manifest atomically: temp file, fsync, rename, fsync the directory."""
    step_dir = Path(step_dir)
    final = step_dir / manifest_name(manifest.rank)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=step_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(step_dir)
    return final


def read_manifest(path: str | os.PathLike) -> RankManifest:
    """Read and validate one manifest file (ManifestError or OSError on failure: a symlink or a
    non-regular file is :class:`UnsafeFileError`, never followed)."""
    path = Path(path)
    return RankManifest.from_json(read_checkpoint_file(path.parent, path.name))


def check_files(step_dir: Path, files: dict[str, FileEntry], full: bool = True) -> tuple[str, int]:
    """("", total size) when every listed file matches, else (first problem, size so far). A listed file
    that is a symbolic link (or reached through one), or not a regular file, does not match."""
    total = 0
    for name, entry in files.items():
        try:
            fd = open_checkpoint_file(step_dir, name)  # never through a symlink; regular files only
        except FileNotFoundError:
            return f"{name}: missing", total
        except OSError as e:
            return f"{name}: {e.strerror or e}", total
        try:
            st = os.fstat(fd)
            if st.st_size != entry.size:
                return f"{name}: size {st.st_size} != {entry.size}", total
            if full:
                try:
                    actual = hash_fd(fd)
                except OSError as e:
                    return f"{name}: unreadable: {e.strerror or e}", total
                if actual.size != entry.size:
                    return f"{name}: size {actual.size} != {entry.size}", total
                if actual.xxh3_128 != entry.xxh3_128:
                    return f"checksum mismatch in {name}", total
        finally:
            os.close(fd)
        total += entry.size
    return "", total


@dataclass
class VerifyResult:
    """Whether a step directory is a complete checkpoint, and if not the first reason why."""

    valid: bool
    reason: str
    step: int | None
    world_size: int | None
    size_bytes: int
    path: Path


def _step_from_name(step_dir: Path) -> int | None:
    m = STEP_DIR_RE.match(step_dir.name)
    return int(m.group(1)) if m else None


def verify_step_dir(step_dir: str | os.PathLike, full: bool = True) -> VerifyResult:
    """Check a step directory; ``full`` also re-hashes every file (else sizes only). Never raises."""
    step_dir = Path(step_dir)
    dir_step = _step_from_name(step_dir)

    def bad(reason: str, world_size: int | None = None, size: int = 0) -> VerifyResult:
        return VerifyResult(False, reason, dir_step, world_size, size, step_dir)

    try:
        if dir_step is None:
            return bad(f"directory name {step_dir.name!r} is not step_NNNNNNNNN")
        try:
            names = sorted(os.listdir(step_dir))
        except FileNotFoundError:
            return bad("directory missing")
        except NotADirectoryError:
            return bad("not a directory")
        except OSError as e:
            return bad(f"unreadable directory: {e.strerror or e}")
        found = {int(m.group(1)): n for n in names if (m := MANIFEST_RE.match(n))}
        if not found:
            return bad("no manifests")
        manifests: dict[int, RankManifest] = {}
        size = 0
        for rank in sorted(found):
            name = found[rank]
            try:
                raw = read_checkpoint_file(step_dir, name)  # a symlinked manifest is never followed
                m = RankManifest.from_json(raw)
            except ManifestError as e:
                return bad(f"torn manifest: {name}: {e}")
            except OSError as e:
                return bad(f"unreadable manifest {name}: {e.strerror or e}")
            if m.rank != rank:
                return bad(f"torn manifest: {name} says rank {m.rank}")
            manifests[rank] = m
            size += len(raw)
        first = manifests[min(manifests)]
        world = first.world_size
        for rank, m in manifests.items():
            if m.world_size != world:
                return bad(f"rank {rank} world_size {m.world_size} != {world}", world)
            if m.step != first.step:
                return bad(f"rank {rank} step {m.step} != {first.step}", world)
            if m.backend != first.backend:
                return bad(f"rank {rank} backend {m.backend!r} != {first.backend!r}", world)
        if first.step != dir_step:
            return bad(f"manifest step {first.step} != directory step {dir_step}", world)
        for rank in range(world):
            if rank not in manifests:
                return bad(f"rank {rank} manifest missing", world)
        extra_ranks = sorted(r for r in manifests if r >= world)
        if extra_ranks:
            return bad(f"rank {extra_ranks[0]} manifest beyond world_size {world}", world)
        seen: dict[str, FileEntry] = {}
        for rank in range(world):
            for name, entry in manifests[rank].files.items():
                if name in seen and seen[name] != entry:
                    return bad(f"{name}: listed by several ranks with different contents", world)
                seen[name] = entry
        reason, data_size = check_files(step_dir, seen, full)
        if reason:
            return bad(reason, world, size + data_size)
        return VerifyResult(True, "ok", dir_step, world, size + data_size, step_dir)
    except Exception as e:  # noqa: BLE001 - the contract is "never raises on bad data"
        return bad(f"unexpected error while verifying: {type(e).__name__}: {e}")


def list_step_dirs(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every step_NNNNNNNNN directory, oldest first; temp and other entries ignored."""
    directory = Path(directory)
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for e in entries:
        m = STEP_DIR_RE.match(e.name)
        if m and e.is_dir(follow_symlinks=False):
            out.append((int(m.group(1)), Path(e.path)))
    out.sort(key=lambda t: t[0])
    return out


def latest_valid(directory: str | os.PathLike, full: bool = True) -> VerifyResult | None:
    """The newest step that verifies (walking down from the newest), or None."""
    for _, path in reversed(list_step_dirs(directory)):
        result = verify_step_dir(path, full=full)
        if result.valid:
            return result
    return None


def is_held(step_dir: str | os.PathLike) -> bool:
    """True when a ``.hold-*`` marker asks retention to keep the step (replication, a pinned resume)."""
    try:
        return any(name.startswith(HOLD_PREFIX) for name in os.listdir(step_dir))
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot look inside: keeping it is the safe answer
