"""The suite's longest-first order comes from a CI run's JUnit XML (scripts/module_times.py), not a hand-kept list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.scripts import script

MODULE_TIMES = script("module_times")

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.shared.test_node_name" name="test_a" time="1.5"><properties>
<property name="started" value="1000.5"/><property name="worker" value="gw1"/></properties></testcase>
<testcase classname="tests.chaos.test_chaos_ci_e2e" name="test_b" time="90.25"><properties>
<property name="cpu_s" value="20.5"/><property name="started" value="1000"/><property name="worker" value="gw0"/>
</properties></testcase>
<testcase classname="tests.chaos.test_chaos_ci_e2e" name="test_c" time="10"><properties>
<property name="cpu_s" value="4.25"/></properties></testcase>
<testcase classname="tests.project.test_module_times.TestInAClass" name="test_d" time="0.5"/>
<testcase classname="tests.test_gone_since" name="test_e" time="30"/>
</testsuite></testsuites>"""


def test_times_per_module_longest_first_from_junit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junit, out = tmp_path / "junit.xml", tmp_path / "times.json"
    junit.write_text(JUNIT)
    assert MODULE_TIMES.main([str(junit), "--out", str(out), "--top", "1"]) == 0
    printed = capsys.readouterr().out
    times = json.loads(out.read_text())
    # summed per file (a class's tests count for its module), a module no longer in tests/ left out, longest first
    assert list(times.items()) == [("chaos/test_chaos_ci_e2e.py", 100.2), ("shared/test_node_name.py", 1.5),
                                   ("project/test_module_times.py", 0.5)]
    assert "chaos/test_chaos_ci_e2e.py  (CPU 24.8 s)" in printed  # the tests' cpu_s (tests/conftest.py) summed


def test_a_missing_or_empty_report_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert MODULE_TIMES.main([str(tmp_path / "none.xml"), "--out", str(tmp_path / "t.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "empty.xml").write_text("<testsuites/>")
    assert MODULE_TIMES.main([str(tmp_path / "empty.xml"), "--out", str(tmp_path / "t.json")]) == 2
    assert "no test case" in capsys.readouterr().err and not (tmp_path / "t.json").exists()


def test_the_timeline_says_which_module_ran_when_and_where(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    assert MODULE_TIMES.timeline(junit) == [("gw0", 0.0, 90.2, "chaos/test_chaos_ci_e2e.py"),
                                            ("gw1", 0.5, 1.5, "shared/test_node_name.py")]
