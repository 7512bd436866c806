"""The end-to-end half of test_tier_metrics.py (real processes, or waits on real time): metrics of sick storage
(issue 32), in process: ``rlsup_tier_stalled`` follows a real persistent tier whose read is blocked, and an
``unkillable`` attempt reaches ``rlsup_restarts_total`` under its own reason."""

from __future__ import annotations

import threading
from pathlib import Path


from supervisor.tiers.persistent import PersistentTier


def test_a_read_that_moves_is_not_cut_one_that_stops_is(tmp_path: Path) -> None:
    tier = PersistentTier(tmp_path / "tier", source=tmp_path / "ckpt")
    tier.reads.deadline_s = 1.0
    release = threading.Event()

    def slow_copy() -> str:  # 3 s in all, a chunk every 0.05 s: past the deadline, never still for it
        for _ in range(60):
            tier.throttle(1)
            release.wait(0.05)
        return "copied"

    assert tier.reads.call(slow_copy, "cut", progress=lambda: tier.moved) == "copied"
    assert tier.reads.call(lambda: release.wait(60), "cut", progress=lambda: tier.moved) == "cut"
    release.set()


