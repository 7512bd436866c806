"""Move torn newest checkpoints aside (``quarantine_invalid``), for trainers that pick "latest" themselves.

HF's ``get_last_checkpoint`` and "newest file wins" scripts load the newest checkpoint they see, even
one rlsup knows is torn. Before an attempt, each checkpoint newer than the newest valid one that fails
its check is renamed ``<name>.rlsup-invalid-<unix time>``: no trainer's own scan matches that name
(``checkpoint-N$``, ``*.pt``, ``*.ckpt``), and nothing is deleted: only the user puts it back (``mv``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from rlsup_format.manifest import KnownDigests
from supervisor import layouts
from supervisor.layouts import single_file


@dataclass(frozen=True)
class Quarantined:
    """One torn checkpoint renamed aside."""

    source: Path
    target: Path
    reason: str


def quarantine_torn(root: Path, layout: str = "auto", pattern: str = "",
                    known: KnownDigests | None = None) -> list[Quarantined]:
    """Rename every torn checkpoint newer than the newest valid one under ``root`` (a layout's steps, or
    single-file checkpoints when no layout recognises it); what was moved. ``known``: checksums already
    computed for unchanged files (:class:`rlsup_format.manifest.KnownDigests`)."""
    torn = torn_newest(root, layout, pattern, known)
    moved = []
    stamp = int(time.time())
    for path, reason in torn:
        path = Path(path)
        if path == root or root not in path.parents:  # never the checkpoint root itself, nothing outside it
            continue
        target = path.with_name(f"{path.name}{single_file.INVALID_MARK}-{stamp}")
        try:
            os.rename(path, target)  # same directory: atomic, and the bytes stay for the user to inspect
        except OSError:
            continue
        moved.append(Quarantined(path, target, reason))
    return moved


def torn_newest(root: Path, layout: str = "auto", pattern: str = "",
                known: KnownDigests | None = None) -> list[tuple[Path, str]]:
    """(path, why) of every torn checkpoint newer than the newest valid one, newest first: a layout's steps,
    or single-file checkpoints when no layout recognises ``root`` (what :func:`quarantine_torn` moves, and
    what the launch line warns of where the trainer picks its own)."""
    torn = [(Path(r.path), r.reason) for r in layouts.torn_newest(root, layout, known)]
    if not torn and layouts.detect_layout(root) == "unknown" and layout in ("auto", single_file.NAME):
        torn = [(r.path, r.reason) for r in single_file.torn_newest(root, pattern)]
    return torn


def quarantined(root: Path) -> list[Path]:
    """Entries moved aside under ``root`` (top level and one level down), for ``rlsup checkpoints list``."""
    found: list[Path] = []
    for pattern in (f"*{single_file.INVALID_MARK}-*", f"*/*{single_file.INVALID_MARK}-*"):
        try:
            found.extend(root.glob(pattern))
        except OSError:
            continue
    return sorted(found)
