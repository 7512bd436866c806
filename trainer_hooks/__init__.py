"""Imported by training code inside every rank: heartbeats, the stop flag, and verified checkpoints.

Stays light on purpose: it never imports ``supervisor``, an HTTP stack or prometheus.
"""

from trainer_hooks.checkpoint import CheckpointManager
from trainer_hooks.heartbeat import heartbeat, section, should_stop
from trainer_hooks.sampler import ResumableSampler
from trainer_hooks.triggers import SaveTrigger

__version__ = "0.1.0"

__all__ = ["CheckpointManager", "ResumableSampler", "SaveTrigger", "heartbeat", "section", "should_stop",
           "__version__"]
