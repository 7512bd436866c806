"""A :class:`~supervisor.tiers.part_protocol.PartStore` over an fsspec URL (``s3://``, ``gs://``,
``memory://`` ...; needs ``fsspec`` and the protocol's package, e.g. ``s3fs``).

An object store has no rename, so the part protocol itself is the commit: each data object is written
in one put (hashed as the bytes pass) and read back, the manifest is put last; a part without its
manifest, or whose objects do not match it, never counts. A killed upload leaves data objects and no
manifest: nothing to clean, the next copy of that part rewrites them. Deletion removes the manifests
first. Steps are verified by :func:`rlsup_format.manifest.verify_step` over :class:`FsspecStep`.
"""

from __future__ import annotations

import contextlib
from typing import BinaryIO, Callable, Iterator

from rlsup_format.digest import FileEntry, copy_hashing
from rlsup_format.manifest import missing_reason
from rlsup_format.names import manifest_name, parse_manifest_rank, parse_step, step_dir_name
from supervisor.tiers.part_protocol import PartError, PartInvalid


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


class FsspecStep:
    """A :class:`rlsup_format.manifest.StepReader` over one step of an :class:`FsspecStore`."""

    def __init__(self, store: "FsspecStore", step: int) -> None:
        self.store = store
        self.base = store.path(step)

    def names(self) -> list[str]:
        return sorted(_basename(n) for n in self.store.ls(self.base))

    def read(self, name: str) -> bytes:
        return self.store.fs.cat_file(f"{self.base}/{name}")

    def check(self, name: str, entry: FileEntry, full: bool) -> str:
        path = f"{self.base}/{name}"
        try:
            size = int(self.store.fs.size(path))
        except FileNotFoundError:
            return missing_reason(name)
        if size != entry.size:
            return f"{name}: size {size} != {entry.size}"
        if full:
            try:
                got = self.store.hash(path)
            except OSError as e:  # deleted or replaced while read (S3: 404, 412 on If-Match)
                return f"{name}: unreadable: {e}"
            if got != entry:
                return f"checksum mismatch in {name}"
        return ""


class FsspecStore:
    """Steps as ``<url>/step_NNNNNNNNN/`` prefixes. ``throttle(n)`` before each chunk read or written."""

    def __init__(self, url: str, throttle: Callable[[int], None] | None = None) -> None:
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
            self.fs, root = fsspec.core.url_to_fs(url, use_listings_cache=False)
        except TypeError:  # a filesystem that takes no such option
            self.fs, root = fsspec.core.url_to_fs(url)
        self.root = root.rstrip("/")
        self.location = url
        self.throttle = throttle

    def path(self, step: int) -> str:
        return f"{self.root}/{step_dir_name(step)}"

    def ls(self, path: str) -> list[str]:
        """Entries under ``path``, never from a cache (FileNotFoundError when there are none)."""
        try:
            return self.fs.ls(path, detail=False, refresh=True)
        except TypeError:  # filesystems without refresh=
            return self.fs.ls(path, detail=False)

    def hash(self, path: str) -> FileEntry:
        with self.fs.open(path, "rb") as f:
            return copy_hashing(f, throttle=self.throttle)

    def steps(self) -> list[int]:
        try:
            names = self.ls(self.root)
        except FileNotFoundError:
            return []
        return sorted({s for n in names if (s := parse_step(_basename(n))) is not None})

    def reader(self, step: int) -> FsspecStep:
        return FsspecStep(self, step)

    def open(self, step: int, name: str) -> BinaryIO:
        return self.fs.open(f"{self.path(step)}/{name}", "rb")

    def put_file(self, step: int, name: str, src: BinaryIO, entry: FileEntry) -> None:
        path = f"{self.path(step)}/{name}"
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(path, "wb") as out:
            got = copy_hashing(src, out, self.throttle)
        if got != entry:
            raise PartInvalid(f"step {step}: {name} reads as {got.size} bytes {got.xxh3_128}, its manifest "
                              f"says {entry.size} {entry.xxh3_128}")
        if self.hash(path) != entry:  # no rename to make it atomic: check what the store kept
            raise PartError(f"{self.location}: {name} of step {step} does not match after upload")

    def put_manifest(self, step: int, rank: int, raw: bytes) -> None:
        path = f"{self.path(step)}/{manifest_name(rank)}"
        self.fs.pipe_file(path, raw)
        if self.fs.cat_file(path) != raw:
            raise PartError(f"{self.location}: {manifest_name(rank)} of step {step} does not read back")

    def remove_manifest(self, step: int, rank: int) -> None:
        try:
            self.fs.rm(f"{self.path(step)}/{manifest_name(rank)}")
        except FileNotFoundError:
            pass

    def delete(self, step: int) -> None:
        base = self.path(step)
        try:
            names = self.ls(base)
        except FileNotFoundError:
            return
        for n in names:  # manifests first: a half-deleted step is never valid
            if parse_manifest_rank(_basename(n)) is not None:
                self.fs.rm(n)
        try:
            self.fs.rm(base, recursive=True)
        except FileNotFoundError:  # an object store has no directories: nothing left is nothing to do
            pass

    def clean(self) -> None:
        """Nothing: no object is ever renamed, so there are no temp objects; a killed upload is a part
        without a manifest, rewritten by the next copy or removed with its step by retention."""

    @contextlib.contextmanager
    def hold(self, step: int) -> Iterator[None]:
        yield  # restores read from the tier while node 0's retention protects the planned step


def is_url(target: str) -> bool:
    """Whether ``target`` names an fsspec URL rather than a local directory (``file://`` is local)."""
    return "://" in target and not target.startswith("file://")


__all__ = ["FsspecStore", "FsspecStep", "is_url"]
