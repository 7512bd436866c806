"""Which steps retention may delete: one pure function for the trainer, the persistent tier and
every node.

The rule, walking from the newest step down: the newest ``keep_last`` valid steps stay; an invalid
step newer than every valid one stays (it may still be being written); a protected step stays (a
resume is using it, a copy holds it); anything else older than the newest valid step goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class StepState:
    """What retention needs to know about one step."""

    step: int
    valid: bool
    protected: bool = False


def steps_to_delete(steps: Iterable[StepState], keep_last: int | None) -> list[int]:
    """The steps that may be deleted, newest first (none when ``keep_last`` is None)."""
    if keep_last is None:
        return []
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1 (or None to keep everything)")
    doomed: list[int] = []
    kept = 0
    for s in sorted(steps, key=lambda s: s.step, reverse=True):
        if s.valid and kept < keep_last:
            kept += 1
            continue
        if kept == 0 or s.protected:
            continue
        doomed.append(s.step)
    return doomed
