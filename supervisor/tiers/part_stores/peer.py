"""A :class:`~supervisor.tiers.part_protocol.PartStore` over a peer's replica namespace, through the public
API of :class:`supervisor.transport.client.PeerClient` only (``index``, ``push_file``, ``fetch_file``,
``delete``).

The peer checks every upload against its entry as the bytes arrive and stores it under its final name
only if it matches; a download is checked against the peer's declared checksum as it arrives (and
again against the manifest's entry by the receiving store). What the peer holds is read from its
index (size and xxh3-128 per file), so checking a replica costs no transfer. Files the client API
needs on local disk (a manifest to push, a file fetched to be copied on) are spooled in ``spool_dir``
under reserved names and removed at once; :func:`rlsup_format.leftovers.clean_leftovers` removes what
a killed process left there.

A peer that refuses an upload because its bytes do not hash to the manifest's checksum is told
:class:`~supervisor.tiers.part_protocol.PartInvalid` once the source file, hashed here only then, confirms
it (the sender never hashes a part before sending: the receivers check every byte as it arrives).

:class:`ChainStore` is one destination made of several peers: each file is pushed once, to the first,
which streams it on to the others as it receives it (:mod:`supervisor.transport.forward`). A peer the
chain did not reach is dropped from it (and named in :attr:`ChainStore.failed`) before the manifest
goes out, so every peer that gets the manifest got every file first.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Sequence

from rlsup_format.digest import FileEntry, copy_hashing, hash_file
from rlsup_format.fileio import remove_path
from rlsup_format.leftovers import clean_leftovers
from rlsup_format.manifest import missing_reason
from rlsup_format.names import Kind, manifest_name, parse_step, reserved_name, step_dir_name
from supervisor.tiers.part_protocol import PartError, PartInvalid

OK = "ok"
QUEUED = "queued"  # a hop answered after storing the file; it sends it on in the background
#: How long a chain's far hops get to show a part they were sent: this, plus the part at 20 MB/s.
ARRIVAL_BASE_S = 30.0
ARRIVAL_MIN_RATE = 20e6


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

    def fetch_into(self, dest: Path, entry: FileEntry, sync_dir: bool = True) -> None:
        self.store.client.fetch_file(self.store.namespace, self.relpath, dest, entry, sync_dir=sync_dir)

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

    def put_file(self, step: int, name: str, src: BinaryIO, entry: FileEntry, *,
                 forward: Sequence[str] = ()) -> dict[str, str]:
        """Push ``src`` (and, with ``forward``, have the peer stream it on to those endpoints: their
        report is returned). PartInvalid when the peer refused bytes that do not match ``entry``."""
        path = getattr(src, "path", None)
        if path is not None:  # a local file: sent as it is, checked by the peer against ``entry``
            return self._push(f"{step_dir_name(step)}/{name}", Path(path), entry, forward)
        with self._spooled(lambda out: copy_hashing(src, out)) as spooled:
            return self._push(f"{step_dir_name(step)}/{name}", spooled, entry, forward)

    def put_manifest(self, step: int, rank: int, raw: bytes, *, forward: Sequence[str] = ()) -> dict[str, str]:
        with self._spooled(lambda out: out.write(raw)) as spooled:
            return self._push(f"{step_dir_name(step)}/{manifest_name(rank)}", spooled, hash_file(spooled),
                              forward)

    def _push(self, relpath: str, path: Path, entry: FileEntry, forward: Sequence[str]) -> dict[str, str]:
        try:
            if forward:
                return self.client.push_file(self.namespace, relpath, path, entry, forward=forward)
            self.client.push_file(self.namespace, relpath, path, entry)
            return {}
        except Exception as e:
            if getattr(e, "status", None) == 400 and "xxh3-128 mismatch" in str(e):
                raise _refused(relpath, path, entry, e) from None
            raise

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


def _refused(relpath: str, path: Path, entry: FileEntry, e: Exception) -> PartError:
    """What a peer's checksum refusal means: the source is not what its manifest says (PartInvalid),
    or, when the source does hash right, the bytes were damaged on the way (retry later)."""
    try:
        got = hash_file(path)
    except OSError as oe:
        return PartInvalid(f"{relpath}: refused by the peer ({e}); reading the source: {oe}")
    if got != entry:
        return PartInvalid(f"{relpath}: the source reads as {got.size} bytes {got.xxh3_128}, its manifest "
                           f"says {entry.size} bytes {entry.xxh3_128} (refused by the peer: {e})")
    return PartError(f"{relpath}: the peer received bytes that do not match, the source does: {e}")


class ChainStep:
    """A :class:`rlsup_format.manifest.StepReader` over the same step on every peer of a chain: a file
    is right only where it is right on all of them, a manifest present only where all hold it."""

    def __init__(self, steps: Sequence[PeerStep]) -> None:
        self.steps = list(steps)

    def names(self) -> list[str]:
        names: set[str] = set()
        for s in self.steps:
            try:
                names.update(s.names())
            except FileNotFoundError:
                pass
        if not names:
            raise FileNotFoundError(f"{self.steps[0].base}: on none of the chain's peers")
        return sorted(names)

    def read(self, name: str) -> bytes:
        return [s.read(name) for s in self.steps][0]  # FileNotFoundError where any lacks it

    def check(self, name: str, entry: FileEntry, full: bool) -> str:
        for s in self.steps:
            reason = s.check(name, entry, full)
            if reason:
                return f"{s.store.location}: {reason}"
        return ""


class ChainStore:
    """A :class:`~supervisor.tiers.part_protocol.PartStore` over several peers (``hops``: each peer's store
    and its endpoint as the peers name it) written through the first, which forwards to the rest.
    Safe for concurrent ``put_file`` calls."""

    def __init__(self, hops: Sequence[tuple[PeerStore, str]]) -> None:
        if not hops:
            raise ValueError("a chain needs at least one peer")
        self.hops = list(hops)
        self._live = list(hops)
        self.failed: dict[str, str] = {}  # endpoint -> why the chain lost it
        self._bytes = 0  # data bytes written through the chain (the far hops' arrival deadline)
        self._lock = threading.Lock()
        self.location = " -> ".join(store.location for store, _ in hops)

    @property
    def reached(self) -> list[str]:
        """Endpoints that took everything written so far."""
        with self._lock:
            return [ep for _, ep in self._live]

    def _first(self) -> tuple[PeerStore, list[str]]:
        with self._lock:
            return self._live[0][0], [ep for _, ep in self._live[1:]]

    def _drop(self, report: dict[str, str]) -> None:
        with self._lock:
            for ep, what in report.items():
                if what not in (OK, QUEUED):
                    self.failed.setdefault(ep, what)
            self._live = [h for h in self._live if h[1] not in self.failed]

    def steps(self) -> list[int]:
        return self.hops[0][0].steps()

    def reader(self, step: int) -> ChainStep:
        with self._lock:
            live = [store for store, _ in self._live]
        return ChainStep([PeerStep(store, step) for store in live])

    def open(self, step: int, name: str) -> BinaryIO:
        return self.hops[0][0].open(step, name)

    def put_file(self, step: int, name: str, src: BinaryIO, entry: FileEntry) -> None:
        first, rest = self._first()
        self._drop(first.put_file(step, name, src, entry, forward=rest))
        with self._lock:
            self._bytes += entry.size

    def put_manifest(self, step: int, rank: int, raw: bytes) -> None:
        """The manifest, last, through the chain; then follow it down (idle, bounded): each hop sends
        files on in the order it stored them and a manifest only after its files, and says how its
        forward went; a hop it did not reach leaves the chain (the engine copies there directly)."""
        first, rest = self._first()
        self._drop(first.put_manifest(step, rank, raw, forward=rest))
        with self._lock:
            live = list(self._live)
            deadline = time.monotonic() + ARRIVAL_BASE_S + self._bytes / ARRIVAL_MIN_RATE
        relpath = f"{step_dir_name(step)}/{manifest_name(rank)}"
        for i in range(1, len(live)):
            asker, (_, ep) = live[i - 1][0], live[i]
            why = self._forward_outcome(asker, relpath, ep, deadline)
            if why != OK:
                self._drop({ep: why, **{e: f"not reached: {ep} failed" for _, e in live[i + 1:]}})
                return

    @staticmethod
    def _forward_outcome(asker: PeerStore, relpath: str, ep: str, deadline: float) -> str:
        """What ``asker`` says of its forward of ``relpath`` to ``ep``, once it is no longer queued."""
        while True:
            try:
                why = asker.client.forward_status(asker.namespace, relpath).get(ep, "not reported by the peer")
            except Exception as e:  # noqa: BLE001 - asked again until the deadline
                why = f"{QUEUED} ({e})"
            if not why.startswith(QUEUED):
                return why
            if time.monotonic() > deadline:
                return "the forwarded copy did not arrive in time"
            time.sleep(0.05)

    def remove_manifest(self, step: int, rank: int) -> None:
        first, _ = self._first()
        first.remove_manifest(step, rank)
        with self._lock:
            rest = list(self._live[1:])
        for store, ep in rest:
            try:
                store.remove_manifest(step, rank)
            except Exception as e:  # noqa: BLE001 - that peer leaves the chain; the others go on
                self._drop({ep: f"removing the old manifest: {e}"})

    def delete(self, step: int) -> None:
        for store, _ in self.hops:
            store.delete(step)

    def clean(self) -> None:
        self.hops[0][0].clean()

    @contextlib.contextmanager
    def hold(self, step: int) -> Iterator[None]:
        yield
