"""Stragglers (issue 19): a rank whose own work stays slower than its peers' is reported, with the
metric and the alert. In-process through synthetic records first, then real: torchrun with four gloo
ranks, one of them working 3x longer per step, scraped by rlsup's metrics and a real Prometheus."""

from __future__ import annotations


import pytest

from rlsup_format.heartbeat_record import HeartbeatRecord
from supervisor.diagnosis.stragglers import StragglerDetector

MS = 1_000_000


def rec(rank: int, step: int, beat: int, prev: int, works: int = 0, work_ns: int = 0) -> HeartbeatRecord:
    return HeartbeatRecord(rank, 100 + rank, step, beat, "none", 0, False, prev_step=step - 1, prev_beat_ns=prev,
                           works=works, work_ns=work_ns)


def arrivals(step: int, slow: set[int], period: int = 120 * MS) -> dict[int, HeartbeatRecord]:
    """Four ranks at ``step``: fast ranks work 40 ms after the previous collective, slow ones 120 ms."""
    def at(s: int, r: int) -> int:
        return s * period + (120 if r in slow else 40) * MS
    return {r: rec(r, step, at(step, r), at(step - 1, r)) for r in range(4)}


def test_arrivals_flag_the_slow_rank_after_a_window_and_clear_it() -> None:
    d = StragglerDetector(factor=1.5, window=5, node="n1")
    reports = [r for step in range(1, 5) for r in d.feed(arrivals(step, {2}))]
    assert reports == [] and d.flagged == set()  # 4 slow steps of a window of 5
    (flag,) = d.feed(arrivals(5, {2}))
    assert (flag.rank, flag.cleared, flag.method, flag.node) == (2, False, "arrival", "n1")
    assert flag.ratio == pytest.approx(3.0) and flag.describe().startswith("straggler: rank 2 (pid 102) on node n1")
    for step in range(6, 10):
        assert d.feed(arrivals(step, set())) == []  # still slow in some of the last 5
    (clear,) = d.feed(arrivals(10, set()))
    assert clear.cleared and d.flagged == set()


def test_one_slow_step_is_not_a_straggler() -> None:
    d = StragglerDetector(factor=1.5, window=5)
    for step in range(1, 30):
        assert d.feed(arrivals(step, {0} if step == 10 else set())) == []  # rank 0 saving once


def test_work_sections_name_the_slow_rank_when_arrivals_are_equal() -> None:
    d = StragglerDetector(factor=1.5, window=3)
    out = []
    for n in range(1, 5):  # heartbeats after the collective: every arrival equal, work timed apart
        records = {r: rec(r, n, n * 100 * MS, (n - 1) * 100 * MS, works=n, work_ns=(90 if r == 1 else 30) * MS)
                   for r in range(4)}
        out += d.feed(records)
    assert [(r.rank, r.method) for r in out] == [(1, "work_section")]


def test_off_and_single_rank() -> None:
    assert StragglerDetector(factor=0, window=3).feed(arrivals(5, {2})) == []
    assert StragglerDetector(factor=1.5, window=1).feed({0: arrivals(5, {0})[0]}) == []


