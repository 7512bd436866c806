"""The memory tier's direct save: the writer copies the snapshot into a ready file, no ``torch.save`` write.

Why: into a tmpfs, ``torch.save`` writes a step through ``write()`` into fresh pages, and the kernel's
per-page work (allocate, look up, account; 262,144 pages per GB) made that write 0.4-1.4 s per GB on
a loaded 2-core machine: a 1 GB step was valid 1.65 s after the call. A copy between two mappings
whose pages are already there runs at memory bandwidth. So the writer process keeps one *spare* per
memory-tier directory: a file under a reserved staging name, allocated and mapped (page tables
populated) in the background once a save is done. The next save's file is built in it: each
tensor's bytes copied from the snapshot buffer to the offset ``torch.save`` would give them, the
small rest (zip headers, the pickle) written beside them, hashed through the same mapping, trimmed to
size, fsynced, and published by :func:`trainer_hooks.step_writer.write_step` (staging, rename,
manifest last) like any other file: valid means what it meant.

Where each tensor goes: :func:`plan_layout` runs ``torch.save`` on the payload (its tensors over the
snapshot buffer) into a :class:`LayoutRecorder` that keeps every byte it is given except those lying
inside the buffer: each of those is a tensor's bytes, known by its address, so the plan says exactly
which tensor goes where (no guess by order or size). A tensor not written whole and once refuses the
plan and the step is saved the usual way. The file is ``torch.save``'s own format and loads with
``torch.load(weights_only=True)``. It needs ``torch.save`` without the zip CRC32 (torch >= 2.6, the
writer's setting), so that the plan reads none of the bytes it places.

The cost: one spare file per rank in the tier between saves (a step's size). A spare is made only
while the tier keeps room for it and the next step of every rank of the node beside it
(:func:`room_for_spare`), so the memory tier's free-space check never sends a step to disk for it.
``CheckpointManager(async_save=True, direct_save=False)`` saves the usual way (``torch.save`` writes
into the tier): the baseline ``benchmarks/bench_async_save.py`` measures against.
"""

from __future__ import annotations

import ctypes
import io
import logging
import mmap
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlsup_format import job_env
from rlsup_format.digest import FileEntry, new_hasher
from rlsup_format.fileio import remove_path
from rlsup_format.names import Kind, reserved_name, staging_label
from trainer_hooks.backends.base import SaveContext
from trainer_hooks.backends.torch_backend import TorchBackend, shard_name
from trainer_hooks.memory_tier import MARGIN_BYTES, MemoryTarget

log = logging.getLogger(__name__)

#: Room a spare keeps beyond the last file's size: the pickle and RNG state vary a little from save to save.
SPARE_SLACK = 1 << 20
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class LayoutError(ValueError):
    """``torch.save`` wrote something the direct save cannot place: save the usual way instead."""


@dataclass
class Layout:
    """Where every byte of the file comes from: ``literals`` (file offset, bytes), and for entry i of the
    snapshot table ``offsets[i]``, the file offset of its bytes (-1 for an empty tensor)."""

    size: int
    literals: list[tuple[int, bytes]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)


def crc32_off() -> bool:
    """Whether ``torch.save`` here skips the zip CRC32 (a plan must not read the bytes it places)."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        return False
    save = getattr(config, "save", None)
    return save is not None and getattr(save, "compute_crc32", True) is False


class RefUnpickler(pickle.Unpickler):
    """Unpickles a snapshot skeleton, each ("t", i) reference becoming ``tensors[i]``."""

    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        return self.tensors[pid[1]]


def rebuild_payload(skeleton: bytes, table: list[tuple], view: memoryview) -> dict[str, Any]:
    """The payload, each tensor over its own slice of the snapshot ``view`` (one storage per tensor, so
    ``torch.save`` writes what a synchronous save would)."""
    tensors: list[torch.Tensor] = []
    for offset, nbytes, dtype_name, shape, is_param, requires_grad in table:
        dtype = getattr(torch, dtype_name)
        if nbytes == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            t = torch.frombuffer(view[offset:offset + nbytes], dtype=dtype).view(shape)
        if is_param:
            t = torch.nn.Parameter(t, requires_grad=requires_grad)
        tensors.append(t)
    return RefUnpickler(io.BytesIO(skeleton), tensors).load()


class LayoutRecorder:
    """A file object for ``torch.save``: keeps what it is given, except bytes lying inside the snapshot
    buffer ``[base, base + size)``, recorded as (file offset, buffer offset, length)."""

    def __init__(self, base: int, size: int) -> None:
        import numpy as np  # the address of a read-only buffer

        self._np = np
        self.base, self.size = base, size
        self.pos = 0
        self.literals: list[tuple[int, bytearray]] = []
        self.refs: list[tuple[int, int, int]] = []

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if n:
            addr = int(self._np.frombuffer(view, dtype=self._np.uint8).ctypes.data)
            if self.base <= addr < self.base + self.size:
                if addr + n > self.base + self.size:
                    raise LayoutError("a write runs past the snapshot buffer")
                self.refs.append((self.pos, addr - self.base, n))
            elif self.literals and self.literals[-1][0] + len(self.literals[-1][1]) == self.pos:
                self.literals[-1][1].extend(view)  # the headers between two tensors: one piece
            else:
                self.literals.append((self.pos, bytearray(view)))
        self.pos += n
        return n

    def tell(self) -> int:
        return self.pos

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False  # sequential writes only, as into a HashingWriter

    def flush(self) -> None:
        """Nothing is buffered."""


def plan_layout(payload: dict[str, Any], table: list[tuple], base: int, size: int) -> Layout:
    """The file ``torch.save`` makes of ``payload`` (its tensors over the snapshot buffer at address
    ``base``, ``size`` bytes, laid out by ``table``). Raises :class:`LayoutError` when a tensor's bytes
    are not written whole and once, or when ``torch.save`` computes a CRC here."""
    if not crc32_off():
        raise LayoutError("torch.save computes the zip CRC32 here (torch < 2.6?)")
    recorder = LayoutRecorder(base, size)
    torch.save(payload, recorder)
    by_start = {entry[0]: i for i, entry in enumerate(table) if entry[1]}
    offsets = [-1] * len(table)
    for file_off, buf_off, n in recorder.refs:
        i = by_start.get(buf_off)
        if i is None or table[i][1] != n or offsets[i] != -1:
            raise LayoutError(f"snapshot bytes [{buf_off}, {buf_off + n}) are not one whole tensor")
        offsets[i] = file_off
    if any(entry[1] and offsets[i] < 0 for i, entry in enumerate(table)):
        raise LayoutError("a tensor was not written by torch.save")
    return Layout(recorder.pos, [(off, bytes(data)) for off, data in recorder.literals], offsets)


@dataclass
class Spare:
    """A spare file: its path, allocated size, and the writer's mapping of it (page tables populated)."""

    path: Path
    size: int
    map: mmap.mmap

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a view is still referenced: the GC unmaps it
            pass


def new_spare(directory: Path, rank: int, size: int) -> Spare:
    """A file of ``size`` allocated bytes in ``directory`` under a reserved staging name (a killed
    writer's spare is removed like any staging leftover), mapped with its page tables populated."""
    path = Path(directory) / reserved_name(Kind.STAGING, f"{staging_label(rank)}_spare")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except BaseException:
        remove_path(path)
        raise
    finally:
        os.close(fd)
    return Spare(path, size, m)


def room_for_spare(directory: Path, want: int) -> bool:
    """Whether the tier keeps room, beside a spare of ``want`` bytes for every rank of this node, for
    each of their next steps (what :meth:`trainer_hooks.memory_tier.MemoryTarget.check` asks)."""
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    limit = os.environ.get(job_env.MEMORY_LIMIT_BYTES, "")
    tier = MemoryTarget(Path(directory), 1, int(limit) if limit.isdigit() else 0)
    return tier.free_bytes() >= 2 * want * ranks + MARGIN_BYTES


#: Copy and hash a tensor this many bytes at a time: each piece is hashed while it is still in the cache.
PIECE = 1 << 20


def build_file(spare: Spare, layout: Layout, snapshot: memoryview, table: list[tuple]) -> FileEntry:
    """Fill the spare in file order, each tensor from the snapshot to its offset and the literals beside
    them, and hash each piece as it is placed (from the spare's mapping, so the hash is of the file's
    bytes); returns the size and xxh3-128 of the file's first ``layout.size`` bytes."""
    pieces = [(off, data) for off, data in layout.literals]
    pieces += [(off, entry) for entry, off in zip(table, layout.offsets) if off >= 0]
    pieces.sort(key=lambda p: p[0])
    dst = torch.frombuffer(spare.map, dtype=torch.uint8).data_ptr()
    src = torch.frombuffer(snapshot, dtype=torch.uint8).data_ptr()
    out = memoryview(spare.map)
    h = new_hasher()
    pos = 0
    try:
        for off, what in pieces:
            if off != pos:
                raise LayoutError(f"the plan leaves bytes [{pos}, {off}) unwritten")
            if isinstance(what, bytes):
                out[off:off + len(what)] = what
                h.update(what)
                pos = off + len(what)
                continue
            buf_off, nbytes = what[0], what[1]
            for start in range(0, nbytes, PIECE):
                n = min(PIECE, nbytes - start)
                ctypes.memmove(dst + off + start, src + buf_off + start, n)  # one thread: no pool to wake per piece
                h.update(out[off + start:off + start + n])
            pos = off + nbytes
        if pos != layout.size:
            raise LayoutError(f"the plan covers {pos} of {layout.size} bytes")
    finally:
        out.release()
    return FileEntry(layout.size, h.hexdigest())


class DirectBackend(TorchBackend):
    """The torch backend whose file is built in a spare (:func:`build_file`): ``save`` fills it, trims
    it to size, fsyncs it and moves it into the staging directory with its entry recorded (publishing
    reads nothing back)."""

    def __init__(self, spare: Spare, layout: Layout, snapshot: memoryview, table: list[tuple]) -> None:
        self.spare, self.layout, self.snapshot, self.table = spare, layout, snapshot, table

    def save(self, ctx: SaveContext, payload: dict[str, Any]) -> None:
        entry = build_file(self.spare, self.layout, self.snapshot, self.table)
        self.spare.close()
        fd = os.open(self.spare.path, os.O_WRONLY | os.O_NOFOLLOW | _CLOEXEC)
        try:
            os.ftruncate(fd, self.layout.size)
            os.fsync(fd)
        finally:
            os.close(fd)
        rel = shard_name(ctx.rank)
        os.rename(self.spare.path, ctx.staging / rel)
        ctx.written[rel] = entry


def discard(spare: Spare) -> None:
    """Unmap and remove a spare that will not be used."""
    spare.close()
    remove_path(spare.path)


class SpareKeeper:
    """Writer side: one spare per memory-tier directory, and the mapping of the trainer's snapshot buffer
    (kept across saves, like the buffer itself, so its page tables are populated once)."""

    def __init__(self) -> None:
        self.spares: dict[str, Spare] = {}
        self.snap: tuple[tuple[int, int, int], mmap.mmap] | None = None

    def snapshot_map(self, fd: int, size: int, keep: bool) -> mmap.mmap:
        """The writer's mapping of the snapshot buffer ``fd``; kept for the next save when ``keep``."""
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, size)
        if self.snap is not None and self.snap[0] == key:
            return self.snap[1]
        self.drop_snapshot_map()
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        if keep:
            self.snap = (key, m)
        return m

    def kept(self, m: mmap.mmap) -> bool:
        return self.snap is not None and self.snap[1] is m

    def drop_snapshot_map(self) -> None:
        if self.snap is not None:
            try:
                self.snap[1].close()
            except BufferError:  # tensors over it still referenced: the GC unmaps it
                pass
            self.snap = None

    def backend_for(self, request: dict, payload: dict[str, Any], snapshot: memoryview, base: int
                    ) -> DirectBackend | None:
        """The backend of a direct save of ``request``, or None (the usual save). The directory's spare
        is taken either way: unused, it is removed, so its room goes to the step."""
        spare = self.spares.pop(str(request["target"].directory), None)
        if spare is None:
            return None
        if not request.get("direct") or request["backend"] != "torch":
            discard(spare)
            return None
        try:
            layout = plan_layout(payload, request["table"], base, request["size"])
            if layout.size > spare.size:
                raise LayoutError(f"the step ({layout.size} bytes) outgrew the spare ({spare.size} bytes)")
        except LayoutError as e:
            log.info("step %d saved the usual way: %s", request["step"], e)
            discard(spare)
            return None
        return DirectBackend(spare, layout, snapshot, request["table"])

    def settle(self, direct: DirectBackend | None) -> None:
        """After a save: a spare that was not published (the part was valid already, or the save
        failed) is removed."""
        if direct is not None and direct.spare.path.exists():
            discard(direct.spare)

    def after(self, request: dict, step_dir: str | None) -> None:
        """After a direct-able save: a spare for the next one into the same directory (when it fits)."""
        if not request.get("direct") or request["backend"] != "torch" or step_dir is None:
            return
        directory = Path(request["target"].directory)
        try:
            size = (Path(step_dir) / shard_name(request["who"].rank)).stat().st_size
            want = size + size // 64 + SPARE_SLACK
            if not room_for_spare(directory, want):
                log.info("no spare in %s: the tier keeps no room for it beside the next steps", directory)
                return
            self.spares[str(directory)] = new_spare(directory, request["who"].rank, want)
        except OSError as e:
            log.warning("no spare file in %s (%s): the next save there is written the usual way", directory, e)

    def close(self) -> None:
        """Remove every spare and unmap the snapshot buffer (the writer stops)."""
        for spare in self.spares.values():
            discard(spare)
        self.spares = {}
        self.drop_snapshot_map()
