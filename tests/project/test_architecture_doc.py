"""docs/architecture.md matches the code: its module table is generated, and every file it names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.scripts import script

ROOT = Path(__file__).resolve().parents[2]


def test_module_table_is_current(capsys: pytest.CaptureFixture[str]) -> None:
    assert script("gen_architecture").main(["--check"]) == 0, capsys.readouterr().err


def test_every_named_file_exists() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:rlsup_format|supervisor|trainer_hooks)/[\w/]+\.py)`", text))
    assert named, "the rules table names no files"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
