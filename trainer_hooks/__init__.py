"""Imported by training code inside every rank: heartbeats, the stop flag, and verified checkpoints.

Stays light on purpose: it never imports ``supervisor``, an HTTP stack or prometheus, and the
checkpoint classes (which need torch) load on first use, so the supervisor can read manifests
without paying for torch.

Under rlsup (``RLSUP_HEARTBEAT_DIR`` set) importing it arms die-with-parent (``PR_SET_PDEATHSIG``,
see :mod:`trainer_hooks.heartbeat`), so a rank that never reaches its first heartbeat still dies with
its launcher.
"""

from typing import Any

from trainer_hooks.heartbeat import heartbeat, section, should_stop

__version__ = "0.1.0"

_LAZY = {
    "CheckpointManager": "trainer_hooks.checkpoint",
    "ResumableSampler": "trainer_hooks.sampler",
    "SaveTrigger": "trainer_hooks.triggers",
    "WorldChange": "trainer_hooks.world",
    "grad_accum_steps": "trainer_hooks.world",
    "prime_ddp": "trainer_hooks.ddp",
}

__all__ = ["CheckpointManager", "ResumableSampler", "SaveTrigger", "WorldChange", "grad_accum_steps", "heartbeat",
           "prime_ddp", "section", "should_stop", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'trainer_hooks' has no attribute {name!r}")
