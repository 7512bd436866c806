"""The suite's house: tests beside the package they test, the tier by file name, and the guard that keeps the
fast tier free of programs (tests/conftest.py)."""

from __future__ import annotations

import ast
import subprocess
import sys

import conftest
import pytest
from support.env import ROOT, TESTS

PACKAGES = {p.name for p in (ROOT / "supervisor").iterdir() if (p / "__init__.py").is_file()}


def _test_modules() -> list:
    return sorted(p for p in TESTS.rglob("test_*.py") if "thirdparty/nanogpt" not in p.as_posix()
                  and "thirdparty/hf_run_clm" not in p.as_posix())


def test_every_test_module_sits_in_a_directory_of_its_concept() -> None:
    loose = [p.name for p in _test_modules() if p.parent == TESTS]
    assert not loose, f"test modules directly under tests/ (put each beside its package: tests/<package>/): {loose}"
    dirs = {p.parent.name for p in _test_modules()}
    assert PACKAGES <= dirs, f"supervisor packages without a tests/<package>/: {sorted(PACKAGES - dirs)}"


def test_a_test_module_imports_no_other_but_its_own_fast_half() -> None:
    names = {p.stem for p in _test_modules()}
    wrong = []
    for path in _test_modules():
        own_fast = path.stem[:-len("_e2e")] if path.stem.endswith("_e2e") else None
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            wrong += [f"{path.relative_to(TESTS)} imports {m}" for m in mods
                      if m.split(".")[-1] in names and m.split(".")[-1] != own_fast]
    assert not wrong, wrong


def test_the_tier_is_the_file_name() -> None:
    assert conftest.is_e2e(TESTS / "cluster" / "test_multinode_e2e.py")
    assert not conftest.is_e2e(TESTS / "cluster" / "test_coordinator.py")


def test_a_fast_test_that_runs_a_program_is_refused_and_failed() -> None:
    """The refusal raises where the program would start; the fixture fails the test at teardown even when the
    test (or a thread of it) caught the refusal. Here the record is cleared after checking it, so this test
    passes."""
    with pytest.raises(RuntimeError, match=r"a fast test started a process \(subprocess.Popen true\)"):
        subprocess.run(["true"], check=False)
    assert conftest._processes_started == ["subprocess.Popen true"]
    conftest._processes_started.clear()
    with pytest.raises(RuntimeError, match="belongs in a \\*_e2e.py module"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)
    conftest._processes_started.clear()
