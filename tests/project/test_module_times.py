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
    # summed per file (a class's tests count for its module), a module no longer in tests/ left out, longest first;
    # a module's CPU is its tests' cpu_s (its wall time where the report has none)
    assert list(times.items()) == [("chaos/test_chaos_ci_e2e.py", {"wall": 100.2, "cpu": 24.8}),
                                   ("shared/test_node_name.py", {"wall": 1.5, "cpu": 1.5}),
                                   ("project/test_module_times.py", {"wall": 0.5, "cpu": 0.5})]
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


def test_with_two_reports_each_module_s_longest_run_counts(tmp_path: Path) -> None:
    """A test that failed early in one run is short there: the other run's time (and CPU) is the module's."""
    a, b, out = tmp_path / "a.xml", tmp_path / "b.xml", tmp_path / "times.json"
    a.write_text(JUNIT)
    b.write_text(JUNIT.replace('time="90.25"', 'time="2"').replace('time="1.5"', 'time="3"'))
    assert MODULE_TIMES.main([str(a), str(b), "--out", str(out)]) == 0
    times = json.loads(out.read_text())
    assert times["chaos/test_chaos_ci_e2e.py"] == {"wall": 100.2, "cpu": 24.8}
    assert times["shared/test_node_name.py"] == {"wall": 3.0, "cpu": 3.0}


def test_the_hand_out_order_is_longest_first_with_wait_bound_modules_spread() -> None:
    from support.hand_out import hand_out_order

    times = {"wait_a.py": {"wall": 150, "cpu": 15}, "wait_b.py": {"wall": 140, "cpu": 20},
             "cpu_a.py": {"wall": 130, "cpu": 120}, "cpu_b.py": {"wall": 100, "cpu": 90},
             "wait_c.py": {"wall": 90, "cpu": 9}, "cpu_c.py": 80, "wait_d.py": {"wall": 10, "cpu": 1}, "bad.py": "x"}
    # wait_b would run beside wait_a: two CPU-bound modules go between them; at the end only waiting ones are left
    assert hand_out_order(times) == ["wait_a.py", "cpu_a.py", "cpu_b.py", "wait_b.py", "cpu_c.py", "wait_c.py",
                                     "wait_d.py"]
    assert hand_out_order({"a.py": 3, "b.py": 5}) == ["b.py", "a.py"]  # the old format: seconds alone
