"""Reading what a run recorded: ``incidents.jsonl`` and ``state.json`` in its state directory."""

from __future__ import annotations

import json
from pathlib import Path


def incidents(state_dir: Path) -> list[dict]:
    """The incidents in ``state_dir/incidents.jsonl`` ([] before the first).

    A final line cut short (no newline after it, not JSON) is what a SIGKILLed rlsup leaves mid-append, and is
    skipped; any other line that is not JSON is a broken record and raises, naming the file and the line."""
    path = state_dir / "incidents.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().split("\n")  # a complete file ends with "\n": its last element is ""
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError as e:
            if i == len(lines) - 1:
                continue  # torn by a kill mid-append
            raise ValueError(f"{path}: line {i + 1} is not a JSON record ({e}): {line[:120]!r}") from None
    return out


def read_state(state_dir: Path) -> dict:
    """``state_dir/state.json``, the run's current state (rlsup replaces it atomically, so it always parses)."""
    return json.loads((state_dir / "state.json").read_text())
