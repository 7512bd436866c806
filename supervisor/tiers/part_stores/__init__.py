"""The stores behind :class:`supervisor.tiers.part_protocol.PartStore`: a local directory (:mod:`.local`),
an object store through fsspec (:mod:`.fsspec_store`), a peer's replica namespace over HTTP (:mod:`.peer`)."""

from __future__ import annotations

from typing import Callable

from supervisor.tiers.part_protocol import PartStore


def open_store(target: str, throttle: Callable[[int], None] | None = None, hold_label: str = "copy") -> PartStore:
    """The store for a ``persistent_dir`` value: an fsspec URL, else a local directory (``file://`` too)."""
    from supervisor.tiers.part_stores.fsspec_store import FsspecStore, is_url
    from supervisor.tiers.part_stores.local import LocalStore

    if is_url(target):
        return FsspecStore(target, throttle)
    return LocalStore(target.removeprefix("file://"), throttle, hold_label)
