"""The records every layout module returns, kept apart so layout modules never import each other."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class CheckpointRecord:
    """One checkpoint step as found on disk: what it is, whether a restart may use it, and why not."""

    step: int
    layout: str
    path: Path
    valid: bool
    reason: str
    size_bytes: int
    role: str | None = None
    notes: list[str] = field(default_factory=list)

    @classmethod
    def of_check(cls, check: "Check", *, step: int | None, layout: str, path: Path, size_bytes: int,
                 role: str | None = None) -> "CheckpointRecord":
        """The record of a step from its integrity check (an unrecognised step number is -1)."""
        return cls(step=-1 if step is None else step, layout=layout, path=path, valid=check.ok,
                   reason=check.reason or "complete", size_bytes=size_bytes, role=role, notes=check.notes)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


@dataclass
class Check:
    """Outcome of one integrity check of one file or directory (``ok`` False: ``reason`` says why)."""

    ok: bool
    reason: str = ""
    notes: list[str] = field(default_factory=list)

    @classmethod
    def good(cls, notes: list[str] | None = None) -> "Check":
        return cls(True, "", list(notes or []))

    @classmethod
    def bad(cls, reason: str, notes: list[str] | None = None) -> "Check":
        return cls(False, reason, list(notes or []))


@dataclass
class TrackerStatus:
    """What a trainer's 'latest' tracker file claims, and whether the claim holds.

    ``ok`` is True only when the tracker parses, names a valid step, and no newer valid step exists.
    """

    directory: Path
    tracker: Path | None
    kind: str | None
    step: int | None
    raw: str | None
    error: str | None
    step_valid: bool | None
    step_reason: str
    newest_valid_step: int | None
    newest_valid_path: Path | None

    @property
    def ok(self) -> bool:
        return (
            self.tracker is not None
            and self.error is None
            and bool(self.step_valid)
            and self.step == self.newest_valid_step
        )

    def describe(self) -> str:
        """One line for humans and logs."""
        if self.tracker is None:
            return f"no tracker file in {self.directory}"
        name = self.tracker.name
        if self.error is not None:
            claim = f"{name} does not hold: {self.error}"
        elif not self.step_valid:
            claim = f"{name} names step {self.step}, which is not usable ({self.step_reason})"
        elif self.step != self.newest_valid_step:
            claim = f"{name} names step {self.step}, but a newer valid step exists"
        else:
            return f"{name} names step {self.step}, the newest valid step"
        newest = "none" if self.newest_valid_step is None else str(self.newest_valid_step)
        return f"{claim}; newest valid step: {newest}"
