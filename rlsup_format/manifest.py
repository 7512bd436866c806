"""The manifest rules: per-rank manifests, and the checks that say a step is complete.

Why manifests: a checkpoint directory that merely *exists* proves nothing. A rank killed mid-save,
a full disk or a flaky filesystem leaves files with the right names and the wrong bytes. Each rank
therefore writes, last of all, a small JSON manifest listing every file it wrote with its size and
xxh3-128 checksum. A step is valid only when the manifests of all ranks 0..W-1 are present, agree
with each other, and every listed file matches. Verification only ever *reads* and never raises on
bad data: corruption is a normal, reported outcome.

Layout::

    <directory>/step_000000100/
        manifest.rank_00000.json   written last by rank 0 (atomic rename)
        manifest.rank_00001.json
        rank_00000.pt ...          files listed in the manifests (backend specific)
        .hold-...                  hold markers: retention never deletes the step
        .staging-rank_00001-...    a save in progress (or a killed one's leftovers)

The checks run over a :class:`StepReader`, so a step in a local directory and one in an object
store (:mod:`supervisor.tiers.part_stores`) are judged by the same code.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

# Re-exported with the manifest because every reader of a step needs them together.
from rlsup_format.digest import CHUNK_SIZE, FileEntry, hash_fd, hash_file  # noqa: F401
from rlsup_format.fileio import UnsafeFileError, fsync_dir, open_nofollow, read_nofollow, write_durable  # noqa: F401
from rlsup_format.names import (  # noqa: F401
    MANIFEST_RE,
    STEP_DIR_RE,
    Kind,
    hold_prefix,
    manifest_name,
    parse_step,
    reserved_name,
    step_dir_name,
)

SCHEMA_VERSION = 1
_HEX128_RE = re.compile(r"^[0-9a-f]{32}$")
_FIELDS = ("schema", "step", "world_size", "rank", "backend", "files", "created",
           "rlsup_version", "extra")
#: The key of a manifest's ``extra`` that says the step may be restored into another world size (written True by
#: ``trainer_hooks`` only when the trainer's state can move: :func:`trainer_hooks.world.resize_blockers`).
RESIZABLE = "resizable"


class ManifestError(ValueError):
    """A manifest that cannot be trusted: bad JSON, wrong types, unsafe paths, unknown schema."""


@lru_cache(maxsize=1)
def _rlsup_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("rlsup")
    except metadata.PackageNotFoundError:
        return "unknown"


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

    @property
    def resizable(self) -> bool:
        """Whether the trainer marked this part as restorable into another world size (:data:`RESIZABLE`)."""
        return self.extra.get(RESIZABLE) is True

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



def write_manifest(step_dir: str | os.PathLike, manifest: RankManifest) -> Path:
    """Publish a rank's manifest atomically: temp file, fsync, rename, fsync the directory."""
    step_dir = Path(step_dir)
    final = step_dir / manifest_name(manifest.rank)
    write_durable(final, manifest.to_json().encode(), step_dir / reserved_name(Kind.TMP, final.name))
    return final


def read_manifest(path: str | os.PathLike) -> RankManifest:
    """Read and validate one manifest file (ManifestError or OSError on failure: a symlink or a
    non-regular file is :class:`rlsup_format.fileio.UnsafeFileError`, never followed)."""
    path = Path(path)
    return RankManifest.from_json(read_nofollow(path.parent, path.name))


class StepReader(Protocol):
    """Read access to one step, wherever it is stored."""

    def names(self) -> list[str]:
        """Top-level entry names of the step (FileNotFoundError when the step is absent)."""

    def read(self, name: str) -> bytes:
        """A manifest's bytes (never through a symlink)."""

    def check(self, name: str, entry: FileEntry, full: bool) -> str:
        """"" when the data file ``name`` matches ``entry`` (sizes only unless ``full``), else why not."""


class KnownDigests:
    """Checksums already computed for files whose identity (device, inode, size, mtime, ctime) has not changed
    since: one restart hashes a step's bytes once (supervisor.run.loop: deciding verifies, preparing reuses).
    A file changed since is hashed again; so is one whose last write was less than :data:`RACY_S` before its hash
    began: a rewrite in place right after the hash could land in the same tick of the kernel's coarse clock (at
    most 10 ms) and keep every field of its identity. The rule is measured from the hash, not from the reuse: a
    step saved just before a crash is still hashed once on the restart path (with a 2 s rule from the reuse it was
    hashed twice: +45 ms of downtime in benchmarks/run.py's restart row). The ranks verify what they load in full
    again. Only checksums are remembered: manifests are read and compared every time."""

    RACY_S = 0.05

    def __init__(self) -> None:
        self._digests: dict[tuple[int, ...], FileEntry] = {}

    @staticmethod
    def identity(st: os.stat_result) -> tuple[int, ...]:
        """What changes when a file is replaced or written (its access time is left out: reading sets it)."""
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def get(self, st: os.stat_result) -> FileEntry | None:
        return self._digests.get(self.identity(st))

    def put(self, st: os.stat_result, digest: FileEntry, hashed_from: float) -> None:
        """Keep ``digest`` of the file ``st`` describes, hashed from wall-clock time ``hashed_from`` on."""
        if st.st_mtime_ns / 1e9 < hashed_from - self.RACY_S:
            self._digests[self.identity(st)] = digest

    def forget(self) -> None:
        self._digests.clear()


class LocalStep:
    """A :class:`StepReader` over a step directory on a local filesystem (``known``: checksums to reuse)."""

    def __init__(self, step_dir: str | os.PathLike, known: KnownDigests | None = None) -> None:
        self.path = Path(step_dir)
        self.known = known

    def names(self) -> list[str]:
        return sorted(os.listdir(self.path))

    def read(self, name: str) -> bytes:
        return read_nofollow(self.path, name)

    def check(self, name: str, entry: FileEntry, full: bool) -> str:
        return check_file(self.path, name, entry, full, self.known)


def missing_reason(name: str) -> str:
    """What every :meth:`StepReader.check` answers for an absent file (callers tell "absent" from "differs")."""
    return f"{name}: missing"


def check_file(step_dir: str | os.PathLike, name: str, entry: FileEntry, full: bool = True,
               known: KnownDigests | None = None) -> str:
    """"" when ``step_dir/name`` is a regular file (reached without a symlink) matching ``entry``; ``known``:
    checksums of unchanged files to reuse, and to add this one's to."""
    try:
        fd = open_nofollow(step_dir, name)
    except FileNotFoundError:
        return missing_reason(name)
    except OSError as e:
        return f"{name}: {e.strerror or e}"
    try:
        st = os.fstat(fd)
        if st.st_size != entry.size:
            return f"{name}: size {st.st_size} != {entry.size}"
        if full:
            actual = known.get(st) if known is not None else None
            if actual is None:
                hashed_from = time.time()
                try:
                    actual = hash_fd(fd)
                except OSError as e:
                    return f"{name}: unreadable: {e.strerror or e}"
                if known is not None and known.identity(os.fstat(fd)) == known.identity(st):  # unchanged meanwhile
                    known.put(st, actual, hashed_from)
            if actual.size != entry.size:
                return f"{name}: size {actual.size} != {entry.size}"
            if actual.xxh3_128 != entry.xxh3_128:
                return f"checksum mismatch in {name}"
    finally:
        os.close(fd)
    return ""


def check_files(step_dir: Path, files: dict[str, FileEntry], full: bool = True) -> tuple[str, int]:
    """("", total size) when every listed file matches, else (first problem, size so far)."""
    return _check_listed(LocalStep(step_dir), files, full)


def _check_listed(reader: StepReader, files: dict[str, FileEntry], full: bool) -> tuple[str, int]:
    total = 0
    for name, entry in files.items():
        reason = reader.check(name, entry, full)
        if reason:
            return reason, total
        total += entry.size
    return "", total


@dataclass
class VerifyResult:
    """Whether a step is a complete checkpoint, and if not the first reason why."""

    valid: bool
    reason: str
    step: int | None
    world_size: int | None
    size_bytes: int
    path: Path | str


def verify_part(reader: StepReader, step: int, rank: int, full: bool = True) -> tuple[RankManifest | None, str]:
    """One rank's part of ``step``: (its manifest, "") when the manifest parses, names this rank and
    step, and every file it lists matches; else (None, why not). Never raises on bad data."""
    name = manifest_name(rank)
    try:
        m = RankManifest.from_json(reader.read(name))
    except FileNotFoundError:
        return None, f"{name}: missing"
    except ManifestError as e:
        return None, f"torn manifest: {name}: {e}"
    except OSError as e:
        return None, f"unreadable manifest {name}: {e.strerror or e}"
    if (m.rank, m.step) != (rank, step):
        return None, f"{name} says step {m.step} rank {m.rank}"
    reason, _ = _check_listed(reader, m.files, full)
    return (None, reason) if reason else (m, "")


def verify_step(reader: StepReader, step: int | None, full: bool = True, where: Path | str = "") -> VerifyResult:
    """Check one step through ``reader``; ``full`` also re-hashes every file (else sizes only).
    ``step``: the step its location names (None: not a step name). Never raises."""

    def bad(reason: str, world_size: int | None = None, size: int = 0) -> VerifyResult:
        return VerifyResult(False, reason, step, world_size, size, where)

    try:
        if step is None:
            return bad(f"directory name {Path(str(where)).name!r} is not step_NNNNNNNNN")
        try:
            names = reader.names()
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
                raw = reader.read(name)
                m = RankManifest.from_json(raw)
            except ManifestError as e:
                return bad(f"torn manifest: {name}: {e}")
            except OSError as e:
                return bad(f"unreadable manifest {name}: {e.strerror or e}")
            if m.rank != rank:
                return bad(f"torn manifest: {name} says rank {m.rank}")
            manifests[rank] = m
            size += len(raw)
        problem, seen = _agreement(manifests, step)
        world = manifests[min(manifests)].world_size
        if problem:
            return bad(problem, world)
        reason, data_size = _check_listed(reader, seen, full)
        if reason:
            return bad(reason, world, size + data_size)
        return VerifyResult(True, "ok", step, world, size + data_size, where)
    except Exception as e:  # noqa: BLE001 - the contract is "never raises on bad data"
        return bad(f"unexpected error while verifying: {type(e).__name__}: {e}")


def _agreement(manifests: dict[int, RankManifest], step: int) -> tuple[str, dict[str, FileEntry]]:
    """("", union of listed files) when the manifests form one complete step, else (why not, {})."""
    first = manifests[min(manifests)]
    world = first.world_size
    for rank, m in manifests.items():
        if m.world_size != world:
            return f"rank {rank} world_size {m.world_size} != {world}", {}
        if m.step != first.step:
            return f"rank {rank} step {m.step} != {first.step}", {}
        if m.backend != first.backend:
            return f"rank {rank} backend {m.backend!r} != {first.backend!r}", {}
    if first.step != step:
        return f"manifest step {first.step} != directory step {step}", {}
    for rank in range(world):
        if rank not in manifests:
            return f"rank {rank} manifest missing", {}
    extra_ranks = sorted(r for r in manifests if r >= world)
    if extra_ranks:
        return f"rank {extra_ranks[0]} manifest beyond world_size {world}", {}
    seen: dict[str, FileEntry] = {}
    for rank in range(world):
        for name, entry in manifests[rank].files.items():
            if name in seen and seen[name] != entry:
                return f"{name}: listed by several ranks with different contents", {}
            seen[name] = entry
    return "", seen


def verify_step_dir(step_dir: str | os.PathLike, full: bool = True, known: KnownDigests | None = None) -> VerifyResult:
    """Check a local step directory (see :func:`verify_step`; ``known``: :class:`KnownDigests`). Never raises."""
    step_dir = Path(step_dir)
    return verify_step(LocalStep(step_dir, known), parse_step(step_dir.name), full, step_dir)


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
        try:
            is_dir = bool(m) and e.is_dir(follow_symlinks=False)
        except OSError:  # EIO on one step (a failing disk or store): that step is missing, the others still count
            continue
        if m and is_dir:
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
    """True when a hold marker asks retention to keep the step (replication, a copy, a pinned resume)."""
    try:
        return any(name.startswith(hold_prefix()) for name in os.listdir(step_dir))
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot look inside: keeping it is the safe answer
