"""Metrics of sick storage (issue 32), in process: ``rlsup_tier_stalled`` follows a real persistent tier whose read
is blocked, and an ``unkillable`` attempt reaches ``rlsup_restarts_total`` under its own reason."""

from __future__ import annotations

import threading
from pathlib import Path

from prometheus_client import generate_latest

from supervisor.lifecycle import EndReason
from supervisor.cli.metrics import SupervisorMetrics
from supervisor.tiers.persistent import PersistentTier
from support.metrics import parse, value
from support.waits import wait_for


def scrape(metrics: SupervisorMetrics) -> dict:
    return parse(generate_latest(metrics.registry).decode())


def test_tier_stalled_gauge_follows_a_blocked_read_of_the_tier(tmp_path: Path) -> None:
    metrics = SupervisorMetrics(job="j", node="n0")
    assert value(scrape(metrics), "rlsup_tier_stalled", tier="persistent") == 0  # exported before any tier runs
    tier = PersistentTier(tmp_path / "tier", source=tmp_path / "ckpt")
    metrics.tier("persistent", tier.stalled)
    tier.reads.deadline_s = 0.2  # the store "hangs": a read that does not come back in time
    release = threading.Event()
    assert tier.reads.call(lambda: release.wait(60), "gave up") == "gave up"
    assert tier.stalled() is not None and "not answered" in tier.stalled()
    assert value(scrape(metrics), "rlsup_tier_stalled", tier="persistent") == 1
    assert tier.reads.call(lambda: "read", "not started") == "not started"  # never a second read beside it
    release.set()  # the store answers
    wait_for(lambda: tier.stalled() is None, 10, "the blocked read to return")
    assert value(scrape(metrics), "rlsup_tier_stalled", tier="persistent") == 0


def test_an_unkillable_attempt_is_counted_under_its_reason() -> None:
    metrics = SupervisorMetrics(job="j", node="n0")
    assert value(scrape(metrics), "rlsup_restarts_total", reason="unkillable") == 0
    metrics.attempt_failed(EndReason.UNKILLABLE.value, 12)
    samples = scrape(metrics)
    assert value(samples, "rlsup_restarts_total", reason="unkillable") == 1
    assert value(samples, "rlsup_restarts_total", reason="exit_code") == 0
