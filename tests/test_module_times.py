"""The suite's longest-first order comes from a CI run's JUnit XML (scripts/module_times.py), not a hand-kept list."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "module_times.py"

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_node_name" name="test_a" time="1.5"/>
<testcase classname="tests.chaos.test_chaos_ci" name="test_b" time="90.25"/>
<testcase classname="tests.chaos.test_chaos_ci" name="test_c" time="10"/>
<testcase classname="tests.test_module_times.TestInAClass" name="test_d" time="0.5"/>
<testcase classname="tests.test_gone_since" name="test_e" time="30"/>
</testsuite></testsuites>"""


def test_times_per_module_longest_first_from_junit(tmp_path: Path) -> None:
    junit, out = tmp_path / "junit.xml", tmp_path / "times.json"
    junit.write_text(JUNIT)
    r = subprocess.run([sys.executable, str(SCRIPT), str(junit), "--out", str(out), "--top", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    times = json.loads(out.read_text())
    # summed per file (a class's tests count for its module), a module no longer in tests/ left out, longest first
    assert list(times.items()) == [("chaos/test_chaos_ci.py", 100.2), ("test_node_name.py", 1.5),
                                   ("test_module_times.py", 0.5)]
    assert "chaos/test_chaos_ci.py" in r.stdout


def test_a_missing_or_empty_report_is_refused(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "none.xml"), "--out", str(tmp_path / "t.json")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no such file" in r.stderr
    (tmp_path / "empty.xml").write_text("<testsuites/>")
    r = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "empty.xml"), "--out", str(tmp_path / "t.json")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no test case" in r.stderr and not (tmp_path / "t.json").exists()
