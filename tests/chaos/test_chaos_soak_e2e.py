"""The randomised soak under pytest: ``pytest tests/chaos --soak MINUTES [--soak-seed N]``."""

from __future__ import annotations

from pathlib import Path

import pytest

from .soak import run_soak


@pytest.mark.soak
@pytest.mark.timeout(0)
def test_soak(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    minutes = request.config.getoption("--soak")
    summary = run_soak(minutes, tmp_path, request.config.getoption("--soak-seed"))
    assert not summary["failures"], summary["failures"]
