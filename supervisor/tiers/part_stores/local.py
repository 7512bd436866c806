"""A :class:`~supervisor.tiers.part_protocol.PartStore` over a local directory of steps: a node's
checkpoint_dir, or a persistent tier on a shared filesystem (Lustre, GPFS, NFS).

Data files are written under a reserved temp name beside their final name (``.tmp-copy-<host>-<pid>-
<token>``, :mod:`rlsup_format.names`), hashed as the bytes pass, fsynced, and renamed only when they
match their entry; manifests go through :func:`rlsup_format.fileio.write_durable`. Nothing is ever
read through a symlink (:func:`rlsup_format.fileio.open_nofollow`). What a killed writer leaves
(temp files, a step being deleted, a hold of a dead process) is removed by
:func:`rlsup_format.leftovers.clean_leftovers` only.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from rlsup_format.digest import FileEntry, copy_hashing
from rlsup_format.fileio import fsync_dir, fsync_dirs, open_nofollow, remove_path, write_durable
from rlsup_format.leftovers import clean_leftovers
from rlsup_format.manifest import LocalStep, list_step_dirs, manifest_name
from rlsup_format.names import Kind, reserved_name, step_dir_name
from supervisor.tiers.part_protocol import PartInvalid

#: Leftover kinds this store removes (a trainer's staging directories are the trainer's own business).
CLEANED = frozenset({Kind.TMP, Kind.INCOMING, Kind.DELETING, Kind.HOLD})


class LocalStore:
    """Steps as ``<root>/step_NNNNNNNNN/`` directories. ``throttle(n)`` is called before each chunk
    written (a bandwidth limit); ``hold_label`` names this store's hold markers (``.hold-<label>-...``)."""

    def __init__(self, root: str | os.PathLike, throttle: Callable[[int], None] | None = None,
                 hold_label: str = "copy") -> None:
        self.root = Path(root)
        self.location = str(self.root)
        self.throttle = throttle
        self.hold_label = hold_label

    def path(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def steps(self) -> list[int]:
        return [step for step, _ in list_step_dirs(self.root)]

    def reader(self, step: int) -> LocalStep:
        return LocalStep(self.path(step))

    def open(self, step: int, name: str) -> BinaryIO:
        f = os.fdopen(open_nofollow(self.path(step), name), "rb", buffering=0)
        f.path = self.path(step) / name  # type: ignore[attr-defined]  # for senders that need a path (HTTP push)
        return f  # type: ignore[return-value]

    def _step_dir(self, step: int, name: str) -> Path:
        """The directory ``name`` goes in, created (and made durable in its parent) when new."""
        step_dir = self.path(step)
        if not step_dir.is_dir():
            self.root.mkdir(parents=True, exist_ok=True)
            step_dir.mkdir(exist_ok=True)
            fsync_dir(self.root)
        parent = (step_dir / name).parent
        if not parent.is_dir():
            parent.mkdir(parents=True, exist_ok=True)
            fsync_dirs([p for p in [parent, *parent.parents] if step_dir in p.parents or p == step_dir])
        return parent

    def put_file(self, step: int, name: str, src: BinaryIO, entry: FileEntry) -> None:
        """Write ``name`` of ``step`` from ``src``, renamed into place only once it matched ``entry``.

        The rename is made durable by the manifest's write (one fsync of the step directory for the
        whole part: a manifest whose files' renames were lost names missing files, an invalid part),
        at once only where it replaced a file (old bytes must never meet a new manifest) or sits in a
        subdirectory."""
        parent = self._step_dir(step, name)
        final = self.path(step) / name
        sync_now = parent != self.path(step) or final.exists()
        fetch_into = getattr(src, "fetch_into", None)
        if fetch_into is not None:  # a peer's file: received once, checked as it arrives, renamed if it matches
            fetch_into(final, entry, sync_now)
            return
        tmp = parent / reserved_name(Kind.TMP, "copy")  # unique per call: copies may run at once
        try:
            with open(tmp, "xb") as out:
                got = copy_hashing(src, out, self.throttle)
                out.flush()
                os.fsync(out.fileno())
            if got != entry:
                raise PartInvalid(f"step {step}: {name} reads as {got.size} bytes {got.xxh3_128}, its manifest "
                                  f"says {entry.size} {entry.xxh3_128}")
            os.replace(tmp, final)  # the final name only for bytes that matched as they passed
        finally:
            tmp.unlink(missing_ok=True)
        if sync_now:
            fsync_dir(parent)

    def put_manifest(self, step: int, rank: int, raw: bytes) -> None:
        step_dir = self._step_dir(step, manifest_name(rank))
        write_durable(step_dir / manifest_name(rank), raw, step_dir / reserved_name(Kind.TMP, manifest_name(rank)))

    def remove_manifest(self, step: int, rank: int) -> None:
        try:
            (self.path(step) / manifest_name(rank)).unlink()
        except FileNotFoundError:
            return
        fsync_dir(self.path(step))  # invalid for good before anything of the part changes

    def delete(self, step: int) -> None:
        """Rename out of the step namespace (one atomic step), then remove: a half-deleted step never
        has a step's name; a killed deletion's leftover is removed by :meth:`clean`."""
        doomed = self.root / reserved_name(Kind.DELETING, step_dir_name(step))
        try:
            os.rename(self.path(step), doomed)
        except FileNotFoundError:
            return
        fsync_dir(self.root)
        remove_path(doomed)

    def clean(self) -> None:
        clean_leftovers(self.root, CLEANED, recursive=True)

    @contextlib.contextmanager
    def hold(self, step: int) -> Iterator[None]:
        marker = self.path(step) / reserved_name(Kind.HOLD, self.hold_label)
        try:
            marker.touch(exist_ok=False)
        except (FileNotFoundError, NotADirectoryError):
            raise PartInvalid(f"step {step} is gone from {self.location}") from None
        except OSError:  # a read-only source (a tier mounted read-only): nothing can delete it either
            yield
            return
        try:
            yield
        finally:
            marker.unlink(missing_ok=True)
