"""The house rules of issue 15, checked on the source so they stay true: small modules and
functions, and each low-level rule written once (in rlsup_format)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlsup_format", "supervisor", "trainer_hooks")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_no_module_over_the_limit() -> None:
    too_long = {str(p.relative_to(ROOT)): n for p in _modules()
                if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"


def test_no_function_over_the_limit() -> None:
    too_long = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long[f"{p.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


# (what, regex over source, the one module allowed to hold it)
ONCE = [
    ("directory fsync", r"os\.O_DIRECTORY\)\s*\n\s*try:\s*\n\s*os\.fsync|def _?fsync_dir\b", "rlsup_format/fileio.py"),
    ("pid liveness", r"os\.kill\([^)]*,\s*0\)", "rlsup_format/fileio.py"),
    ("xxh3 hasher", r"xxhash\.xxh3_128\(", "rlsup_format/digest.py"),
    ("no-follow open of a file", r"O_NOFOLLOW \| os\.O_NONBLOCK|def _?open_(regular_)?nofollow|def _open_step_file", "rlsup_format/fileio.py"),
    ("step directory name", r"re\.compile\(r\"\^step_|f\"step_\{", "rlsup_format/names.py"),
    ("manifest name", r"f\"manifest\.rank_\{", "rlsup_format/names.py"),
    ("the manifest's completeness rules", r"manifest missing\"|def verify_step_dir\b", "rlsup_format/manifest.py"),
    ("retention decision", r"valid_kept|kept\s*<\s*(self\.)?keep_last|kept\s*==\s*self\.keep_last|newest_valid_seen", "rlsup_format/retention.py"),
]


@pytest.mark.parametrize("what,pattern,home", ONCE, ids=[o[0] for o in ONCE])
def test_rule_lives_in_one_place(what: str, pattern: str, home: str) -> None:
    where = sorted(str(p.relative_to(ROOT)) for p in _modules() if re.search(pattern, p.read_text()))
    assert where == [home], f"{what}: expected only in {home}, found in {where}"


RESERVED_LITERALS = re.compile(r"[\"'](\.staging-|\.deleting-|\.hold-|\.incoming-|\.part-|\.fetch-)")


def test_reserved_names_come_from_rlsup_format_names() -> None:
    offenders = sorted(str(p.relative_to(ROOT)) for p in _modules()
                       if p.parts[-2] != "rlsup_format" and RESERVED_LITERALS.search(p.read_text()))
    assert not offenders, f"reserved names spelled by hand (use rlsup_format.names.reserved_name): {offenders}"
