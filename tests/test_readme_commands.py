"""The README's first screen is what a new user types: CI must run exactly its test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _first_block_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no bash block on its first screen"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_ci_runs_the_readme_test_command() -> None:
    setup_demo, test_cmd = _first_block_commands()
    assert setup_demo.startswith("bash scripts/setup.sh") and "rlsup demo" in setup_demo
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == test_cmd, f".ci/run runs {ci[-1]!r}, the README says {test_cmd!r}"


def test_ci_checks_the_import_boundaries() -> None:
    _, test_cmd = _first_block_commands()
    assert ".venv/bin/lint-imports" in test_cmd
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "[tool.importlinter]" in pyproject and 'type = "acyclic_siblings"' in pyproject
