"""A :class:`~supervisor.part_protocol.PartStore` over a peer's replica namespace, through the public
API of :class:`supervisor.transport.client.PeerClient` only (``index``, ``push_file``, ``fetch_file``,
``delete``).

The peer checks every upload against its entry as the bytes arrive and stores it under its final name
only if it matches; a download is checked against the peer's declared checksum as it arrives (and
again against the manifest's entry by the receiving store). What the peer holds is read from its
index (size and xxh3-128 per file), so checking a replica costs no transfer. Files the client API
needs on local disk (a manifest to push, a file fetched to be copied on) are spooled in ``spool_dir``
under reserved names and removed at once; :func:`rlsup_format.leftovers.clean_leftovers` removes what
a killed process left there.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from rlsup_format.digest import FileEntry, copy_hashing
from rlsup_format.fileio import remove_path
from rlsup_format.leftovers import clean_leftovers
from rlsup_format.manifest import missing_reason
from rlsup_format.names import Kind, manifest_name, parse_step, reserved_name, step_dir_name


class PeerStep:
    """A :class:`rlsup_format.manifest.StepReader` over one step of a peer's index (read once)."""

    def __init__(self, store: "PeerStore", step: int) -> None:
        self.store = store
        self.base = step_dir_name(step)
        self.index = store.client.index(store.namespace)

    def names(self) -> list[str]:
        prefix = self.base + "/"
        names = sorted({k[len(prefix):].split("/", 1)[0] for k in self.index if k.startswith(prefix)})
        if not names:
            raise FileNotFoundError(f"{self.store.location}: no {self.base}")
        return names

    def read(self, name: str) -> bytes:
        if f"{self.base}/{name}" not in self.index:
            raise FileNotFoundError(f"{self.store.location}: {self.base}/{name} not held")
        with self.store.download(f"{self.base}/{name}") as f:
            return f.read()

    def check(self, name: str, entry: FileEntry, full: bool) -> str:
        held = self.index.get(f"{self.base}/{name}")
        if held is None:
            return missing_reason(name)
        if held.size != entry.size:
            return f"{name}: size {held.size} != {entry.size}"
        return "" if held == entry else f"checksum mismatch in {name}"


class PeerFile:
    """A peer's file, fetched on first use. A local destination calls :meth:`fetch_into` and the bytes
    land once, straight under their final name (checked against the entry as they arrive, renamed only
    if they match); any other reader gets the file spooled locally first."""

    def __init__(self, store: "PeerStore", relpath: str) -> None:
        self.store, self.relpath = store, relpath
        self._spooled: BinaryIO | None = None

    def fetch_into(self, dest: Path, entry: FileEntry) -> None:
        self.store.client.fetch_file(self.store.namespace, self.relpath, dest, entry)

    def _file(self) -> BinaryIO:
        if self._spooled is None:
            self._spooled = self.store.download(self.relpath)
        return self._spooled

    def read(self, n: int = -1) -> bytes:
        return self._file().read(n)

    def readinto(self, buf: Any) -> int | None:
        return self._file().readinto(buf)

    def close(self) -> None:
        if self._spooled is not None:
            self._spooled.close()

    def __enter__(self) -> "PeerFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PeerStore:
    """The replica namespace ``namespace`` on the peer ``client`` talks to; ``name`` for messages."""

    def __init__(self, client: Any, namespace: str, spool_dir: str | os.PathLike, name: str = "") -> None:
        self.client = client
        self.namespace = namespace
        self.spool_dir = Path(spool_dir)
        self.location = name or f"{client!r}/{namespace}"

    def steps(self) -> list[int]:
        index = self.client.index(self.namespace)
        return sorted({s for k in index if (s := parse_step(k.split("/", 1)[0])) is not None and "/" in k})

    def reader(self, step: int) -> PeerStep:
        return PeerStep(self, step)

    def download(self, relpath: str) -> BinaryIO:
        """``relpath`` fetched into the spool and opened (its name is gone already: nothing to remove)."""
        spool = self.spool_dir / reserved_name(Kind.INCOMING, "peer")
        spool.mkdir(parents=True)
        try:
            self.client.fetch_file(self.namespace, relpath, spool / "data")
            return open(spool / "data", "rb", buffering=0)
        finally:
            remove_path(spool)

    def open(self, step: int, name: str) -> BinaryIO:
        return PeerFile(self, f"{step_dir_name(step)}/{name}")  # type: ignore[return-value]

    def put_file(self, step: int, name: str, src: BinaryIO, entry: FileEntry) -> None:
        path = getattr(src, "path", None)
        if path is not None:  # a local file: sent as it is, checked by the peer against ``entry``
            self.client.push_file(self.namespace, f"{step_dir_name(step)}/{name}", path, entry)
            return
        with self._spooled(lambda out: copy_hashing(src, out)) as spooled:
            self.client.push_file(self.namespace, f"{step_dir_name(step)}/{name}", spooled, entry)

    def put_manifest(self, step: int, rank: int, raw: bytes) -> None:
        with self._spooled(lambda out: out.write(raw)) as spooled:
            from rlsup_format.digest import hash_file

            self.client.push_file(self.namespace, f"{step_dir_name(step)}/{manifest_name(rank)}", spooled,
                                  hash_file(spooled))

    @contextlib.contextmanager
    def _spooled(self, write: Any) -> Iterator[Path]:
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.spool_dir / reserved_name(Kind.TMP, "peer")
        try:
            with open(tmp, "xb") as out:
                write(out)
            yield tmp
        finally:
            tmp.unlink(missing_ok=True)

    def remove_manifest(self, step: int, rank: int) -> None:
        self.client.delete(self.namespace, f"{step_dir_name(step)}/{manifest_name(rank)}")

    def delete(self, step: int) -> None:
        self.client.delete(self.namespace, step_dir_name(step))

    def clean(self) -> None:
        clean_leftovers(self.spool_dir, {Kind.TMP, Kind.INCOMING})

    @contextlib.contextmanager
    def hold(self, step: int) -> Iterator[None]:
        yield  # a replica is deleted only when its owner deletes the step
