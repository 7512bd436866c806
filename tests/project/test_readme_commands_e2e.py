"""The README's first screen is what a new user types: the first command sets up rlsup's core alone and runs the
demo on it; the second sets up everything the tests need and runs them, exactly as CI does."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from support.core_only import core_only_env

ROOT = Path(__file__).resolve().parents[2]
FULL_EXTRAS = "test,megatron,nvrx,trainers"  # what the test set-up adds to the core (scripts/setup.sh)


def _first_block_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no bash block on its first screen"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_ci_runs_the_readme_test_command() -> None:
    setup_demo, test_cmd = _first_block_commands()
    assert setup_demo.startswith("bash scripts/setup.sh --core && ") and "rlsup demo" in setup_demo
    assert test_cmd.startswith("bash scripts/setup.sh && ")
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == test_cmd, f".ci/run runs {ci[-1]!r}, the README says {test_cmd!r}"


def test_ci_checks_the_import_boundaries() -> None:
    _, test_cmd = _first_block_commands()
    assert ".venv/bin/lint-imports" in test_cmd
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "[tool.importlinter]" in pyproject and 'type = "acyclic_siblings"' in pyproject


def _dry_setup(tmp_path: Path, command: str, venv: bool) -> tuple[subprocess.CompletedProcess, list[str], list[str]]:
    """The set-up part of the README's ``command`` run against stubs that record their calls: ``python3`` (whose
    ``-m venv`` makes a stub ``.venv/bin/python``), that venv python (there already when ``venv``) and
    ``scripts/install_system_deps.sh``. Returns the run, every call and the arguments of each ``pip install``:
    what the set-up would install, without pip or apt."""
    setup = command.split("&&", 1)[0].strip()
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", scripts)
    calls = shlex.quote(str(tmp_path / "calls"))
    (scripts / "install_system_deps.sh").write_text(f"echo system-deps >> {calls}\n")
    venv_python = tmp_path / "venv-python"
    venv_python.write_text(f'#!/bin/sh\necho "venv-python $*" >> {calls}\n')
    python3 = tmp_path / "python3"
    python3.write_text(f'#!/bin/sh\necho "python3 $*" >> {calls}\n'
                       f'[ "$1 $2" = "-m venv" ] && mkdir -p "$3/bin" && cp {shlex.quote(str(venv_python))} "$3/bin/python"\nexit 0\n')
    for stub in (venv_python, python3):
        stub.chmod(0o755)
    if venv:
        (tmp_path / ".venv" / "bin").mkdir(parents=True)
        shutil.copy(venv_python, tmp_path / ".venv" / "bin" / "python")
    out = subprocess.run(setup, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": str(python3)})
    recorded = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    pip = [c.split(" install ", 1)[1] for c in recorded if c.startswith("venv-python -m pip ")]
    return out, recorded, pip


def test_the_first_command_sets_up_the_core_alone(tmp_path: Path) -> None:
    """On a fresh machine: a venv, CPU torch first, then rlsup with no extra; no apt. (Its demo runs on the core
    alone: the last test here.)"""
    setup_demo, _ = _first_block_commands()
    out, calls, pip = _dry_setup(tmp_path, setup_demo, venv=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert calls[0] == "python3 -m venv .venv" and "system-deps" not in calls, calls
    assert pip == ["--upgrade pip", "torch==2.13.0", "-e ."], pip


def test_the_second_command_adds_every_test_extra_to_the_same_venv(tmp_path: Path) -> None:
    """The system tools, the same torch line, then the extras, into the venv already there (a --core one is
    upgraded in place, never made again); every extra it names is one pyproject defines."""
    _, test_cmd = _first_block_commands()
    out, calls, pip = _dry_setup(tmp_path, test_cmd, venv=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert calls[0] == "system-deps" and not any(c.startswith("python3 ") for c in calls), calls
    assert pip[:3] == ["--upgrade pip", "torch==2.13.0", f"-e .[{FULL_EXTRAS}]"], pip
    section = re.search(r"^\[project\.optional-dependencies\]\n(.*?)^\[", (ROOT / "pyproject.toml").read_text(),
                        re.M | re.S)
    assert section, "pyproject.toml has no [project.optional-dependencies]"
    extras = re.findall(r"^([\w-]+) = ", section.group(1), re.M)
    assert set(FULL_EXTRAS.split(",")) <= set(extras), extras


def test_setup_refuses_an_unknown_argument(tmp_path: Path) -> None:
    out, calls, _ = _dry_setup(tmp_path, "bash scripts/setup.sh --cor", venv=False)
    assert out.returncode == 2 and "unknown argument '--cor'" in out.stderr and not calls, (out.stderr, calls)


def test_the_demo_and_the_commands_it_and_the_readme_print_work_as_printed_on_the_core_alone(tmp_path: Path) -> None:
    """A newcomer runs the README's demo line in a clone (here: a directory holding the clone's .venv, every
    non-core distribution in it made to look absent, as after ``setup.sh --core``), then types what the demo's
    hint and the README say, exactly: each works (not "rlsup: command not found")."""
    venv = ROOT / ".venv"
    if not (venv / "bin" / "rlsup").exists():
        pytest.skip("no .venv (scripts/setup.sh makes it)")
    (tmp_path / ".venv").symlink_to(venv)
    setup_demo, _ = _first_block_commands()
    demo = setup_demo.split("&&", 1)[1].strip()
    assert demo == ".venv/bin/rlsup demo"
    env, refused = core_only_env(tmp_path / "core-only")

    def sh(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=240)

    ran = sh(f"{demo} --steps 10 --crash-at-step 7")  # the README's line, shorter (the same code path)
    assert ran.returncode == 0, ran.stdout + ran.stderr + refused.read_text()
    hints = re.findall(r"\(try: (.+)\)$", ran.stdout, re.M)
    readme = re.findall(r"`(\.venv/bin/rlsup [^`]+)` shows", (ROOT / "README.md").read_text())
    assert hints and readme, (hints, readme)
    for command in hints + readme:
        out = sh(command)
        assert out.returncode == 0 and "succeeded" in out.stdout, (command, out.stdout + out.stderr)
