"""The part-transfer protocol, written once: how one rank's part of a step moves between stores.

A *part* is one rank's manifest plus the files it lists (:mod:`rlsup_format.manifest`). It lives in a
:class:`PartStore`: a local checkpoint directory or filesystem tier (:mod:`supervisor.tiers.part_stores.local`),
an object store (:mod:`supervisor.tiers.part_stores.fsspec_store`), or a peer's replica namespace over HTTP
(:mod:`supervisor.tiers.part_stores.peer`). Every copy, whatever the direction (a node pushing to a peer,
a node persisting its parts, a restore from a peer or from the persistent tier), is :func:`copy_part`:

1. the source part is verified (manifest parses, names this rank and step, every file matches);
   a source that does not is :class:`PartInvalid` and nothing is written;
2. a destination that already holds a valid part with the same files is left as it is;
3. a file present in the destination that another rank's manifest there lists with other contents
   is never overwritten (:class:`PartConflict`): that would break the other rank's part;
4. an old part of this rank in the destination loses its manifest *first*, so it is invalid from
   the first byte written on;
5. data files are written, several at once, each checked against its :class:`FileEntry` by the
   checksum computed while the bytes pass (a store with renames writes a temp name and renames; an
   object store writes the object and reads it back); nothing is read again afterwards;
6. the manifest is written last: it is the commit. A copy cut off anywhere before leaves a part
   without its manifest, which no reader counts (a step is valid only with all its manifests).

:func:`fetch_part` tries a list of holders in order, in one place: a holder whose part is invalid
is reported as such (the caller stops offering it), any other failure is an I/O problem that says
nothing about the holder's copy.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import BinaryIO, Callable, ContextManager, Protocol, Sequence

from rlsup_format.digest import FileEntry
from rlsup_format.fileio import UnsafeFileError
from rlsup_format.manifest import ManifestError, RankManifest, StepReader, manifest_name, missing_reason, verify_part
from rlsup_format.names import parse_manifest_rank


class PartError(RuntimeError):
    """A part could not be copied: an I/O problem, a conflict, a destination that did not take it."""


class PartInvalid(PartError):
    """The source's part is missing, torn, or does not match its manifest: stop offering it."""


class PartConflict(PartError):
    """The destination holds another rank's part that lists one of this part's files with other contents."""


class PartStore(Protocol):
    """Where parts of steps live. Names are step numbers and '/'-separated paths inside a step."""

    location: str

    def steps(self) -> list[int]:
        """Steps present (valid or not), oldest first."""

    def reader(self, step: int) -> StepReader:
        """Read access to ``step`` for the manifest rules (:func:`rlsup_format.manifest.verify_step`)."""

    def open(self, step: int, name: str) -> BinaryIO:
        """A data file for reading (never through a symlink); FileNotFoundError when absent."""

    def put_file(self, step: int, name: str, src: BinaryIO, entry: FileEntry) -> None:
        """Store ``src`` as ``name``, checked against ``entry`` by the checksum of the bytes as they
        pass; it has its final name only if it matches. :class:`PartInvalid` when the bytes read do not
        match (the source is not what its manifest says)."""

    def put_manifest(self, step: int, rank: int, raw: bytes) -> None:
        """Publish a rank's manifest: the commit of its part."""

    def remove_manifest(self, step: int, rank: int) -> None:
        """Make a part invalid (absent is fine)."""

    def delete(self, step: int) -> None:
        """Remove a whole step, manifests first (a half-deleted step is never valid)."""

    def clean(self) -> None:
        """Remove what killed copies left behind (:func:`rlsup_format.leftovers.clean_leftovers`)."""

    def hold(self, step: int) -> ContextManager[None]:
        """Ask retention to keep ``step`` while it is read (PartInvalid when the step is gone)."""


@dataclass(frozen=True)
class Copied:
    """What :func:`copy_part` did: ``written`` False when the destination already held the part."""

    manifest: RankManifest
    written: bool

    @property
    def size(self) -> int:
        return sum(e.size for e in self.manifest.files.values())


def read_part(reader: StepReader, step: int, rank: int, full: bool = True) -> tuple[RankManifest, bytes]:
    """The manifest (parsed and raw) of ``rank``'s valid part of ``step``. :class:`PartInvalid` when the
    part is missing, torn or does not match; any other read error (OSError, a transport error)
    propagates, so a flaky read never condemns a copy."""
    name = manifest_name(rank)
    try:
        raw = reader.read(name)
    except FileNotFoundError:
        raise PartInvalid(f"step {step}: {name} missing") from None
    except UnsafeFileError as e:
        raise PartInvalid(f"step {step}: {name}: {e.strerror or e}") from None
    try:
        m = RankManifest.from_json(raw)
    except ManifestError as e:
        raise PartInvalid(f"step {step}: torn manifest {name}: {e}") from None
    if (m.rank, m.step) != (rank, step):
        raise PartInvalid(f"step {step}: {name} says step {m.step} rank {m.rank}")
    for rel, entry in m.files.items():
        reason = reader.check(rel, entry, full)
        if reason:
            raise PartInvalid(f"step {step} rank {rank}: {reason}")
    return m, raw


def part_state(reader: StepReader, step: int, rank: int, full: bool = True) -> tuple[str, RankManifest | None]:
    """("valid", manifest), ("missing", None) or ("invalid", None) for ``rank``'s part of ``step``."""
    try:
        return "valid", read_part(reader, step, rank, full)[0]
    except PartInvalid:
        try:
            reader.read(manifest_name(rank))
        except FileNotFoundError:
            return "missing", None
        except UnsafeFileError:
            pass  # a symlink or a non-regular file where the manifest goes: invalid, replaced
        return "invalid", None


def _same(a: RankManifest, b: RankManifest) -> bool:
    return (a.files, a.world_size, a.step, a.backend) == (b.files, b.world_size, b.step, b.backend)


def check_no_conflict(reader: StepReader, step: int, rank: int, files: dict[str, FileEntry]) -> None:
    """:class:`PartConflict` when another rank's manifest in ``reader`` lists one of ``files`` with
    other contents (overwriting it would break that rank's part, and the step could never verify)."""
    if not files:
        return
    try:
        names = reader.names()
    except FileNotFoundError:
        return
    for name in names:
        other_rank = parse_manifest_rank(name)
        if other_rank is None or other_rank == rank:
            continue
        try:
            other = RankManifest.from_json(reader.read(name))
        except (FileNotFoundError, ManifestError):
            continue
        for rel, entry in files.items():
            if rel in other.files and other.files[rel] != entry:
                raise PartConflict(f"step {step}: {rel} is listed by {name} with other contents; "
                                   f"not overwriting another rank's part")


def copy_part(src: PartStore, dst: PartStore, step: int, rank: int, *, full: bool = True,
              accept: Callable[[RankManifest], str] | None = None, keep_valid: bool = True) -> Copied:
    """Copy ``rank``'s part of ``step`` from ``src`` to ``dst`` (the module docstring's six rules).

    ``full``: the source's files are hashed before anything is written (else sizes only; each file is
    still checked by the checksum of the bytes copied). ``accept(manifest)``: "" to go on, else why the
    part must not be copied (another job's part): :class:`PartInvalid`. ``keep_valid``: a valid part
    already in ``dst`` is kept even when its files differ (a valid copy is never rewritten, so a failed
    copy cannot turn it invalid); False mirrors the source (a replica follows its owner). Raises
    :class:`PartInvalid` (the source), :class:`PartConflict`, :class:`PartError` or I/O errors."""
    with src.hold(step):
        m, raw = read_part(src.reader(step), step, rank, full)
        why = accept(m) if accept is not None else ""
        if why:
            raise PartInvalid(f"step {step} rank {rank}: {why}")
        target = dst.reader(step)
        state, have = part_state(target, step, rank)
        if have is not None and (keep_valid or _same(have, m)):
            return Copied(have, False)
        # Files already right (listed by several ranks, or left whole by an earlier try) stay as they are.
        todo = {rel: why for rel, entry in sorted(m.files.items()) if (why := target.check(rel, entry, True))}
        check_no_conflict(target, step, rank, {rel: m.files[rel] for rel, why in todo.items()
                                               if why != missing_reason(rel)})  # only files it would overwrite
        if state != "missing":
            dst.remove_manifest(step, rank)  # the old part is invalid before its first byte changes
        _copy_files(src, dst, step, rank, {rel: m.files[rel] for rel in todo})
        dst.put_manifest(step, rank, raw)  # last: the part counts from here on, and only whole
        _, reason = verify_part(dst.reader(step), step, rank, full=False)
        if reason:
            dst.remove_manifest(step, rank)
            raise PartError(f"step {step} rank {rank}: {dst.location}: does not verify after the copy: {reason}")
    return Copied(m, True)


#: Files of one part copied at once: a part of a sharded save has several, and one stream rarely fills
#: a link, a parallel filesystem or the cores that hash.
PARALLEL_FILES = 4


def _copy_files(src: PartStore, dst: PartStore, step: int, rank: int, files: dict[str, FileEntry]) -> None:
    """Copy ``files`` (each checked by the checksum of its bytes as they pass), up to
    :data:`PARALLEL_FILES` at once; the first failure is raised once every started copy ended."""

    def one(rel: str) -> None:
        try:
            f = src.open(step, rel)
        except (FileNotFoundError, UnsafeFileError) as e:
            raise PartInvalid(f"step {step} rank {rank}: {rel}: {e}") from None
        with f:
            dst.put_file(step, rel, f, files[rel])

    if len(files) <= 1:
        for rel in files:
            one(rel)
        return
    with concurrent.futures.ThreadPoolExecutor(min(PARALLEL_FILES, len(files)), "rlsup-part-copy") as pool:
        futures = [pool.submit(one, rel) for rel in sorted(files)]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise next((e for e in errors if isinstance(e, PartInvalid)), errors[0])


class FetchFailed(PartError):
    """No holder gave a valid part. ``invalid``: the holders whose part is invalid (stop offering
    them); the others failed for reasons that say nothing about their copy."""

    def __init__(self, message: str, invalid: list[PartStore]) -> None:
        super().__init__(message)
        self.invalid = invalid


def fetch_part(holders: Sequence[PartStore], dst: PartStore, step: int, rank: int, *,
               accept: Callable[[RankManifest], str] | None = None,
               describe: Callable[[PartStore], str] | None = None) -> tuple[PartStore, Copied]:
    """Copy ``rank``'s part of ``step`` into ``dst`` from the first of ``holders`` that has it whole.

    A holder's files are not hashed beforehand: each is checked by the checksum of its bytes as they
    arrive, and the manifest is written only after all of them matched. Returns (the holder used, what
    was copied); :class:`FetchFailed` naming every holder's failure when none did. ``describe(holder)`` names a holder in messages (default: its location)."""
    errors: list[str] = []
    invalid: list[PartStore] = []
    for holder in holders:
        name = describe(holder) if describe is not None else holder.location
        try:
            return holder, copy_part(holder, dst, step, rank, full=False, accept=accept)
        except PartInvalid as e:
            invalid.append(holder)
            errors.append(f"{name}: invalid: {e}")
        except Exception as e:  # noqa: BLE001 - an I/O problem with this holder: try the next one
            errors.append(f"{name}: {e}")
    raise FetchFailed(f"could not fetch step {step} rank {rank}: {'; '.join(errors) or 'no holder'}", invalid)
