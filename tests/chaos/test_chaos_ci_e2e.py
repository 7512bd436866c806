"""Chaos CI subset: fixed seeds, every scenario kind once, all invariants checked (about 5 min on 2 cores).

Scenarios needing root (tmpfs mounts) or a C compiler (the wall-clock shim) skip with the reason.
The checkpoint tiers (async writer process, persistent tier) are in scenarios_tiers.py, multi-node
(daemons killed mid-transfer, a replacement node killed mid-fetch) in scenarios_multinode.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .scenarios import (ScenarioResult, bad_config_scenario, clock_jump_scenario, corruption_scenario,
                        disk_full_scenario, hostile_client_scenario, hostile_peer_scenario, kill_scenario,
                        replica_disk_full_scenario)
from .scenarios_multinode import fetch_kill_scenario, transfer_kill_scenario
from .scenarios_tiers import async_write_scenario, persistent_copy_scenario

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]


@pytest.fixture(scope="session")
def ref_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chaos-reference")


def verdict(res: ScenarioResult) -> None:
    print(res.summary())
    skips = [p for p in res.problems if p.startswith("SKIP:")]
    if skips:
        pytest.skip(skips[0][5:].strip())
    assert not res.problems, "\n".join(res.problems) + "\n" + res.log[-6000:]


def test_kill_every_moment_single_rank_then_supervisor_stopped_costs_nothing(tmp_path: Path, ref_cache: Path) -> None:
    """Every kill kind at every moment, one rank; then (once test_supervisor_stopped_and_continued_costs_nothing)
    rlsup SIGSTOPped mid-save for 2 s and continued: no incident, no restart, nothing lost (check_incidents
    counts one incident per kill, none for the stop). The stop comes last: it eats most of an attempt, so a
    fault planned after it would find none."""
    plan = [("rank_kill", "mid_save"), ("rank_kill", "mid_manifest"), ("rank_stop", "random"),
            ("supervisor_kill", "mid_save"), ("node_kill", "random"), ("rank_kill", "mid_load"),
            ("supervisor_stop", "mid_save")]
    verdict(kill_scenario(tmp_path / "s", ref_cache, seed=1001, world=1, plan=plan))


def test_kill_torchrun_two_ranks(tmp_path: Path, ref_cache: Path) -> None:
    plan = [("rank_kill", "mid_save"), ("rank_stop", "random"), ("supervisor_kill", "mid_manifest")]
    verdict(kill_scenario(tmp_path / "s", ref_cache, seed=2002, world=2, plan=plan))


def test_disk_full_checkpoint_dir(tmp_path: Path, ref_cache: Path) -> None:
    verdict(disk_full_scenario(tmp_path / "s", ref_cache, seed=3003))


def test_disk_full_replica_store(tmp_path: Path) -> None:
    verdict(replica_disk_full_scenario(tmp_path / "s", seed=3004))


def test_bitflips_truncations_hostile_manifests(tmp_path: Path, ref_cache: Path) -> None:
    verdict(corruption_scenario(tmp_path / "s", ref_cache, seed=4004))


def test_wall_clock_jumps_are_not_hangs(tmp_path: Path, ref_cache: Path) -> None:
    verdict(clock_jump_scenario(tmp_path / "s", ref_cache, seed=5005))


def test_hostile_peer(tmp_path: Path) -> None:
    verdict(hostile_peer_scenario(tmp_path / "s", seed=6006))


def test_hostile_client_against_daemon(tmp_path: Path) -> None:
    verdict(hostile_client_scenario(tmp_path / "s", seed=7007))


def test_bad_config_input(tmp_path: Path) -> None:
    verdict(bad_config_scenario(tmp_path / "s", seed=8008))


def test_async_writer_killed_mid_write(tmp_path: Path, ref_cache: Path) -> None:
    # The writer process itself, the rank (its writer dies with it), rlsup alone, rlsup and the job:
    # each while the background writer is frozen inside a write (staging dir, or data in place and no manifest).
    plan = [("writer_kill", "mid_write"), ("rank_kill", "mid_manifest"), ("supervisor_kill", "mid_write"),
            ("node_kill", "mid_write")]
    verdict(async_write_scenario(tmp_path / "s", ref_cache, seed=9009, world=1, plan=plan))


def test_persistent_tier_killed_mid_copy_and_mid_fetch(tmp_path: Path, ref_cache: Path) -> None:
    # rlsup+job killed mid-copy, the local dir wiped, the next rlsup killed while fetching the step back,
    # the one after resumes from the persistent tier; then rlsup alone killed mid-copy.
    plan = [("node_kill", "mid_copy", True), ("supervisor_kill", "mid_fetch", False),
            ("supervisor_kill", "mid_copy", False)]
    verdict(persistent_copy_scenario(tmp_path / "s", ref_cache, seed=9010, plan=plan))


def test_multinode_daemon_killed_mid_transfer(tmp_path: Path) -> None:
    verdict(transfer_kill_scenario(tmp_path / "s", seed=9011, victims=["sender", "receiver"]))


def test_multinode_replacement_killed_mid_fetch(tmp_path: Path, ref_cache: Path) -> None:
    verdict(fetch_kill_scenario(tmp_path / "s", ref_cache, seed=9012, kills=1))
