#!/usr/bin/env python3
"""Per-module test times and CPU from CI runs' JUnit XML, written to tests/module_times.json: the order the suite
hands modules to its workers is generated from them (tests/support/hand_out.py), never kept by hand.

    python scripts/module_times.py .ci/junit.xml            # rewrite tests/module_times.json
    python scripts/module_times.py a.xml b.xml              # each module's longest run of the two
    python scripts/module_times.py .ci/junit.xml --top 15   # and print the 15 longest modules, with their CPU
    python scripts/module_times.py .ci/junit.xml --timeline # and when each module ran, on which worker
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
OUT = TESTS / "module_times.json"


def module_of(classname: str) -> str | None:
    """``tests.chaos.test_chaos_ci`` (or ``tests.test_x.TestClass``) -> ``chaos/test_chaos_ci_e2e.py``: the longest
    prefix of the dotted name that is a test file under tests/."""
    parts = classname.split(".")
    if parts and parts[0] == "tests":
        parts = parts[1:]
    for end in range(len(parts), 0, -1):
        rel = "/".join(parts[:end]) + ".py"
        if (TESTS / rel).is_file():
            return rel
    return None


def module_times(junit: Path) -> dict[str, float]:
    """Seconds per test module (setup, call and teardown of each of its tests), from one JUnit XML file."""
    times: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = module_of(case.get("classname", ""))
        if module is not None:
            times[module] += float(case.get("time") or 0.0)
    return {m: round(t, 1) for m, t in sorted(times.items(), key=lambda kv: (-kv[1], kv[0]))}


def module_cpu(junit: Path) -> dict[str, float]:
    """CPU seconds per test module, from the ``cpu_s`` property tests/conftest.py gives each test (empty for a
    report without it)."""
    cpu: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = module_of(case.get("classname", ""))
        for prop in case.iter("property"):
            if module is not None and prop.get("name") == "cpu_s":
                cpu[module] += float(prop.get("value") or 0.0)
    return {m: round(c, 1) for m, c in cpu.items()}


def longest_of(runs: list[tuple[dict[str, float], dict[str, float]]]) -> tuple[dict[str, float], dict[str, float]]:
    """Per module, the wall time of its longest run and that run's CPU, longest first."""
    best: dict[str, tuple[float, float | None]] = {}
    for times, cpu in runs:
        for m, t in times.items():
            if m not in best or t > best[m][0]:
                best[m] = (t, cpu.get(m))
    ordered = sorted(best.items(), key=lambda kv: (-kv[1][0], kv[0]))
    return {m: t for m, (t, _) in ordered}, {m: c for m, (_, c) in ordered if c is not None}


def timeline(junit: Path) -> list[tuple[str, float, float, str]]:
    """``(worker, start, seconds, module)`` per module run, in start order, start in seconds from the first test's
    (from the ``started`` and ``worker`` properties tests/conftest.py writes; empty for a report without them)."""
    runs: dict[tuple[str, str], list[float]] = {}  # (worker, module) -> [first start, seconds]
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = module_of(case.get("classname", ""))
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if module is None or "started" not in props:
            continue
        run = runs.setdefault((props.get("worker") or "-", module), [float(props["started"]), 0.0])
        run[0] = min(run[0], float(props["started"]))
        run[1] += float(case.get("time") or 0.0)
    if not runs:
        return []
    t0 = min(start for start, _ in runs.values())
    return sorted(((w, round(s - t0, 1), round(d, 1), m) for (w, m), (s, d) in runs.items()), key=lambda r: (r[1], r[0]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("junit", type=Path, nargs="+", help="the JUnit XML a CI run wrote (.ci/run: --junitxml=.ci/junit.xml); "
                    "with several, each module's longest run counts (a test that failed early in one run is short there)")
    ap.add_argument("--top", type=int, default=0, help="print the N longest modules")
    ap.add_argument("--out", type=Path, default=OUT, help="where to write the times (default: %(default)s)")
    ap.add_argument("--timeline", action="store_true", help="print when each module started, on which worker")
    args = ap.parse_args(argv)
    for junit in args.junit:
        if not junit.is_file():
            print(f"module_times: {junit}: no such file (run the suite with --junitxml first)", file=sys.stderr)
            return 2
    runs = [(module_times(j), module_cpu(j)) for j in args.junit]
    if not all(times for times, _ in runs):
        print(f"module_times: {' '.join(map(str, args.junit))}: a report has no test case of tests/ in it",
              file=sys.stderr)
        return 2
    times, cpu = longest_of(runs)
    args.out.write_text(json.dumps({m: {"wall": t, "cpu": cpu.get(m, t)} for m, t in times.items()}, indent=1) + "\n")
    for module, seconds in list(times.items())[:args.top]:
        print(f"{seconds:8.1f}s  {module}" + (f"  (CPU {cpu[module]:.1f} s)" if module in cpu else ""))
    if args.timeline:
        for worker, start, seconds, module in timeline(args.junit[-1]):
            print(f"{start:8.1f}s {worker:>4} {seconds:7.1f}s  {module}" + (f"  (CPU {cpu[module]:.1f} s)" if module in cpu else ""))
    print(f"module_times: {len(times)} modules, {sum(times.values()):.0f} s in all -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
