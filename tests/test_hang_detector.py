"""HangDetector's timeouts on real heartbeat files (written in the trainer_hooks record format)."""

from __future__ import annotations

import os
from pathlib import Path

from supervisor.hang_detector import AutoTimeout, HangDetector
from trainer_hooks.heartbeat import MAGIC, RECORD, RECORD_SIZE, SECTIONS, rank_file_name

S = 1_000_000_000


def write_record(directory: Path, rank: int, beat_ns: int = 0, section: str = "none", section_ns: int = 0,
                 step: int = 0) -> None:
    data = bytearray(RECORD_SIZE)
    RECORD.pack_into(data, 0, 2, MAGIC, os.getpid(), step, beat_ns, SECTIONS[section], section_ns, 0, 0, 0)
    (directory / rank_file_name(rank)).write_bytes(bytes(data))


def detector(directory: Path) -> HangDetector:
    d = HangDetector(directory, startup_timeout=10, save_timeout=100, explicit_timeout=5,
                     auto=AutoTimeout(5, 1, 600, 5))
    d.started_ns = 1_000 * S
    return d


def test_no_rank_registered_is_a_startup_timeout(tmp_path: Path) -> None:
    d = detector(tmp_path)
    assert d.check(now_ns=1_009 * S) is None
    verdict = d.check(now_ns=1_011 * S)
    assert verdict is not None and verdict.reason == "startup_timeout"


def test_a_long_first_restore_is_held_to_save_timeout_not_startup(tmp_path: Path) -> None:
    """A large checkpoint's first load outlasts startup_timeout: not a hang while within save_timeout."""
    d = detector(tmp_path)
    write_record(tmp_path, 0, section="load", section_ns=1_001 * S)
    assert d.check(now_ns=1_050 * S) is None  # 49 s in the load > startup_timeout 10 s
    verdict = d.check(now_ns=1_102 * S)
    assert verdict is not None and verdict.reason == "save_timeout" and verdict.rank == 0
    # The load ended at 1_090 s: startup counts from there (first step due within startup_timeout).
    write_record(tmp_path, 0, section="none", section_ns=1_090 * S)
    assert d.check(now_ns=1_099 * S) is None
    verdict = d.check(now_ns=1_101 * S)
    assert verdict is not None and verdict.reason == "startup_timeout"


def test_silence_after_heartbeats_is_a_hang(tmp_path: Path) -> None:
    d = detector(tmp_path)
    write_record(tmp_path, 0, beat_ns=1_002 * S)
    write_record(tmp_path, 1, beat_ns=1_006 * S)
    assert d.check(now_ns=1_006 * S) is None
    verdict = d.check(now_ns=1_008 * S)
    assert verdict is not None and verdict.reason == "heartbeat_timeout" and verdict.rank == 0


def test_an_exiting_rank_is_held_to_save_timeout(tmp_path: Path) -> None:
    """After its last step a rank's interpreter teardown is not a hang (trainer_hooks marks 'exit')."""
    d = detector(tmp_path)
    write_record(tmp_path, 0, beat_ns=1_001 * S, section="exit", section_ns=1_002 * S)
    assert d.check(now_ns=1_050 * S) is None  # 48 s in the exit > heartbeat timeout 5 s: exiting, not hung
    verdict = d.check(now_ns=1_103 * S)
    assert verdict is not None and verdict.reason == "save_timeout" and verdict.rank == 0


def test_last_step_is_the_ranks_once_they_beat_beside_the_output(tmp_path: Path) -> None:
    """The output's record (``progress``; HF prints global_step + 1) does not set the last step once the
    ranks heartbeat themselves; alone, it does."""
    d = detector(tmp_path)
    write_record(tmp_path, -1, beat_ns=1_001 * S, step=10)
    d.scan()
    assert d.last_step() == 10
    write_record(tmp_path, 0, beat_ns=1_002 * S, step=4)
    d.scan()
    assert d.last_step() == 4
