"""The README's first screen is what a new user types: CI must run exactly its test command."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

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


def test_the_demo_and_the_commands_it_and_the_readme_print_work_as_printed(tmp_path: Path) -> None:
    """A newcomer runs the README's demo line in a clone (here: a directory holding the clone's .venv), then
    types what the demo's hint and the README say, exactly: each works (not "rlsup: command not found")."""
    from conftest import clean_env

    venv = ROOT / ".venv"
    if not (venv / "bin" / "rlsup").exists():
        pytest.skip("no .venv (scripts/setup.sh makes it)")
    (tmp_path / ".venv").symlink_to(venv)
    setup_demo, _ = _first_block_commands()
    demo = setup_demo.split("&&", 1)[1].strip()
    assert demo == ".venv/bin/rlsup demo"

    def sh(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, shell=True, cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                              timeout=240)

    ran = sh(f"{demo} --steps 10 --crash-at-step 7")  # the README's line, shorter (the same code path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    hints = re.findall(r"\(try: (.+)\)$", ran.stdout, re.M)
    readme = re.findall(r"`(\.venv/bin/rlsup [^`]+)` shows", (ROOT / "README.md").read_text())
    assert hints and readme, (hints, readme)
    for command in hints + readme:
        out = sh(command)
        assert out.returncode == 0 and "succeeded" in out.stdout, (command, out.stdout + out.stderr)
