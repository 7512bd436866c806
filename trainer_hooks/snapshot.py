"""The blocking part of an asynchronous save: the payload copied off the live tensors into a shared buffer.

See :mod:`trainer_hooks.async_writer` for why a ``memfd``, why pinned, and why the buffer is reused.
"""

from __future__ import annotations

import io
import logging
import mmap
import os
import pickle
from typing import Any

import torch

log = logging.getLogger(__name__)

ALIGN = 64


def by_reference(t: torch.Tensor) -> bool:
    """Dense CPU/CUDA tensors go through the shared buffer; anything exotic is pickled whole."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
            and t.device.type in ("cpu", "cuda") and not t.is_quantized and not t.is_nested
            and not t.is_meta)


class RefPickler(pickle.Pickler):
    """Pickles the payload with every shareable tensor replaced by ("t", index); collects them."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}  # id(tensor) -> index: a tensor listed twice is saved once

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if by_reference(obj):
                i = self._index.get(id(obj))
                if i is None:
                    i = self._index[id(obj)] = len(self.tensors)
                    self.tensors.append(obj)
                return ("t", i)
            if obj.device.type != "cpu":
                raise ValueError(f"async_save cannot snapshot a {type(obj).__name__} on {obj.device} "
                                 f"(layout {obj.layout}); use async_save=False")
        return None


class SnapshotBuffer:
    """An anonymous shared-memory region (memfd), mapped here; pinned for CUDA copies when asked."""

    def __init__(self, size: int, pin: bool) -> None:
        self.size = max(size, ALIGN)
        self.fd = os.memfd_create("rlsup-ckpt", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self.map = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.base: torch.Tensor | None = torch.frombuffer(self.map, dtype=torch.uint8)
        self.pinned = False
        if pin:
            self.pin()

    def pin(self) -> None:
        if self.pinned or self.base is None:
            return
        try:
            err = torch.cuda.cudart().cudaHostRegister(self.base.data_ptr(), self.size, 0)
            self.pinned = int(getattr(err, "value", err)) == 0
        except Exception as e:  # noqa: BLE001 - pinning is an optimisation
            log.debug("could not pin the snapshot buffer: %s", e)

    def view(self, offset: int, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        assert self.base is not None
        return self.base[offset:offset + nbytes].view(t.dtype).view(t.shape)

    def close(self) -> None:
        if self.pinned and self.base is not None:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.base.data_ptr())
            except Exception:  # noqa: BLE001
                pass
            self.pinned = False
        self.base = None
        try:
            self.map.close()
        except BufferError:  # a view is still referenced somewhere: the GC unmaps it later
            pass
        try:
            os.close(self.fd)
        except OSError:
            pass


def snapshot(payload: dict[str, Any], buffers: list[SnapshotBuffer]) -> tuple[bytes, list[tuple], SnapshotBuffer]:
    """Copy ``payload`` off the live objects: (pickled skeleton, tensor table, buffer holding the bytes).

    Reuses a buffer from ``buffers`` (removed from the list) when one fits, else allocates one.
    """
    skeleton, tensors, table, size = describe(payload)
    return skeleton, table, copy_to_buffer(tensors, table, size, buffers)


def describe(payload: dict[str, Any]) -> tuple[bytes, list[torch.Tensor], list[tuple], int]:
    """(pickled skeleton, the tensors it references, their table, the bytes a snapshot buffer needs)."""
    out = io.BytesIO()
    pickler = RefPickler(out)
    pickler.dump(payload)
    tensors = pickler.tensors
    table: list[tuple] = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        table.append((offset, nbytes, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                      isinstance(t, torch.nn.Parameter), bool(t.requires_grad)))
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return out.getvalue(), tensors, table, offset


def copy_to_buffer(tensors: list[torch.Tensor], table: list[tuple], offset: int, buffers: list[SnapshotBuffer]) -> SnapshotBuffer:
    """Copy ``tensors`` into a shared buffer (reused from ``buffers`` when one fits) at their table offsets."""
    cuda = any(t.is_cuda for t in tensors)
    buf = None
    for i, b in enumerate(buffers):
        if offset <= b.size <= max(2 * offset, ALIGN):
            buf = buffers.pop(i)
            break
    if buf is None:
        buf = SnapshotBuffer(offset, pin=cuda)
    elif cuda:
        buf.pin()
    devices = set()
    with torch.no_grad():
        for t, (off, nbytes, *_rest) in zip(tensors, table):
            if nbytes == 0:
                continue
            non_blocking = t.is_cuda and buf.pinned
            buf.view(off, t).copy_(t.detach(), non_blocking=non_blocking)
            if non_blocking:
                devices.add(t.device)
    for d in devices:
        torch.cuda.synchronize(d)
    return buf
