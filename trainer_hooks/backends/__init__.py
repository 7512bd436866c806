"""Checkpoint storage backends: how a rank's state becomes files under a step directory.

A backend only writes files (into a private staging directory laid out like the final step
directory) and reads them back; :mod:`trainer_hooks.step_writer` owns the atomic protocol around it
(fsync, rename, manifests, retention) for synchronous and asynchronous saves alike. Backends are
imported lazily so that an optional dependency (megatron-core) costs nothing unless it is used.
"""

from __future__ import annotations

import importlib

from trainer_hooks.backends.base import Backend, LoadContext, SaveContext

_REGISTRY = {
    "torch": "trainer_hooks.backends.torch_backend:TorchBackend",
    "dcp": "trainer_hooks.backends.dcp_backend:DcpBackend",
    "megatron": "trainer_hooks.backends.megatron_backend:MegatronBackend",
}


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str) -> Backend:
    """A fresh backend instance by name ("torch", "dcp", "megatron")."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown checkpoint backend {name!r}; choose one of {available_backends()}") from None
    module_name, cls_name = target.split(":")
    return getattr(importlib.import_module(module_name), cls_name)()


__all__ = ["Backend", "LoadContext", "SaveContext", "available_backends", "get_backend"]
