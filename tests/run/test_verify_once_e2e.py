"""The end-to-end half of test_verify_once.py (real processes, or waits on real time): issue 42, choose once per
failure: a restart hashes the chosen step's bytes once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest


from test_verify_once import STEP_10, restart





@pytest.mark.parametrize("quarantine", [False, True], ids=["plain", "quarantine_invalid"])
def test_a_restart_hashes_the_chosen_step_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quarantine: bool) -> None:
    """The marker verified step 10; preparing (and, with quarantine_invalid, looking for torn steps above it) reuses
    its checksums: each of its files is hashed once in the restart, and attempt 1 resumes from it."""
    counts, layer = restart(tmp_path, monkeypatch, quarantine_invalid=quarantine)
    assert counts == Counter({name: 1 for name in STEP_10})
    assert layer.jobs[1].env["RLSUP_RESUME_STEP"] == "10"


