"""rlsup_format in-process: reserved names round-trip, the one leftover rule, the one retention rule."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rlsup_format.names import Kind, host_tag, parse_reserved, reserved_name
from rlsup_format.retention import StepState, steps_to_delete


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("label", ["", "rank_00001", "step_000000100", "with-dashes-in-it"])
def test_reserved_names_round_trip(kind: Kind, label: str) -> None:
    name = reserved_name(kind, label)
    assert name.startswith(".")
    res = parse_reserved(name)
    assert res is not None
    assert (res.kind, res.label, res.host, res.pid) == (kind, label, host_tag(), os.getpid())
    assert res.mine()
    assert reserved_name(kind, label) != name  # a fresh token each time


@pytest.mark.parametrize("name", ["step_000000001", "manifest.rank_00000.json", ".hidden", ".tmp-x",
                                  ".nokind-host-1-ab", ".tmp-host-notapid-ab", "rank_00000.pt"])
def test_other_names_are_not_reserved(name: str) -> None:
    assert parse_reserved(name) is None


def test_reserved_label_cannot_escape_its_directory() -> None:
    with pytest.raises(ValueError):
        reserved_name(Kind.TMP, "../x")


# (steps as (step, valid, protected), keep_last) -> steps deleted, newest first
RETENTION = [
    ([(10, True, False), (9, True, False), (8, True, False)], 2, [8]),
    ([(10, False, False), (9, True, False), (8, True, False)], 1, [8]),       # newest invalid: maybe in progress
    ([(10, True, False), (9, False, False), (8, True, False)], 2, [9]),       # invalid between valid ones goes
    ([(10, True, False), (9, True, True), (8, True, False)], 1, [8]),         # protected stays, does not count
    ([(3, False, False), (2, False, False)], 1, []),                          # nothing valid: keep everything
    ([(5, True, False), (4, True, False)], None, []),                          # no retention
    ([(12, False, True), (11, True, False), (10, True, False)], 1, [10]),     # a protected newer step
]


@pytest.mark.parametrize("steps,keep,expected", RETENTION)
def test_retention_rule(steps: list, keep: int | None, expected: list[int]) -> None:
    assert steps_to_delete([StepState(*s) for s in steps], keep) == expected


def test_retention_refuses_zero() -> None:
    with pytest.raises(ValueError):
        steps_to_delete([StepState(1, True)], 0)


def test_hash_own_file_equals_the_streamed_hash(tmp_path: Path) -> None:
    """The writer hashes its own staging files through a mapping; every checker streams: same digest."""
    from rlsup_format.digest import CHUNK_SIZE, hash_file, hash_own_file

    for size in (0, 1, CHUNK_SIZE, CHUNK_SIZE + 7, 3 * CHUNK_SIZE - 1):
        path = tmp_path / f"f{size}"
        path.write_bytes(os.urandom(size))
        assert hash_own_file(path) == hash_file(path), size


def test_a_zombie_writer_is_gone_so_its_leftovers_are_stale() -> None:
    """A writer killed with its parent waits as a zombie until something reaps it (an init that reaps late):
    its hold markers and temp files must be cleanable meanwhile (chaos: a stale hold pinned a step forever)."""
    from rlsup_format.fileio import pid_alive

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the child has ended (a zombie: not reaped yet)
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1][1:2] == b"Z":
                    break
            time.sleep(0.01)
        assert not pid_alive(pid)
        assert pid_alive(os.getpid())
    finally:
        os.waitpid(pid, 0)
