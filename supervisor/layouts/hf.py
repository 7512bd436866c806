"""Hugging Face Transformers Trainer and TRL (checkpoint-N/).

Stub: not yet implemented (issue 18); never detected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from supervisor.layouts.record import CheckpointRecord

NAME = "hf"


def looks_like(root: Path) -> bool:
    return False


def owns(path: Path) -> bool:
    """Whether ``path`` is one step of this layout (for :func:`supervisor.layouts.verify_path`)."""
    return False


def list_steps(root: Path) -> list[tuple[int, Path]]:
    return []


def make_context(root: Path) -> Any:
    return None


def verify_step(path: Path, step: int | None = None, ctx: Any = None) -> CheckpointRecord:
    raise NotImplementedError
