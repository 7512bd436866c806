"""Issue 42, choose once per failure: a restart hashes the chosen step's bytes once.

Deciding whether the failed attempt made progress verifies the newest step, checksums and all (the progress
marker, supervisor.tiers.resume.newest_step); preparing the next attempt chooses the same step by the same rule and
reuses those checksums for files unchanged since (rlsup_format.manifest.KnownDigests), so nothing is hashed twice
while the job is down. A file changed in between is hashed again, and a step that no longer verifies is not
resumed from. The real run loop over the fake process layer (tests/support/fake_run_loop.py); a node's count in a
multi-node round is in test_multinode_loop.py.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest

from rlsup_format.manifest import KnownDigests, verify_step_dir
from supervisor.config import SupervisorConfig
from supervisor.run.loop import Supervisor

from support.fake_run_loop import Attempt, FakeProcesses, Recorder
from support.files import count_hashes, saved_step

STEP_5 = ["step_000000005/rank_00000.pt", "step_000000005/rank_00001.pt"]
STEP_10 = ["step_000000010/rank_00000.pt", "step_000000010/rank_00001.pt"]


def restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, between: Callable[[], None] | None = None,
            **cfg: object) -> tuple[Counter[str], FakeProcesses]:
    """Attempt 0 fails over steps 5 and 10 (both valid, saved an hour ago), attempt 1 succeeds; ``between`` runs
    after deciding and before preparing (in the backoff). What the restart hashed (from attempt 0 running to
    attempt 1 running), and the process layer."""
    ckpt = tmp_path / "ckpt"
    saved_step(ckpt, 5, range(2), 2)
    saved_step(ckpt, 10, range(2), 2)
    counts, restart_counts = count_hashes(monkeypatch), Counter[str]()
    layer = FakeProcesses(Attempt(exit_code=1, on_tick=(1, counts.clear)),  # attempt 0's own launch is not counted
                          Attempt(exit_code=0, on_tick=(1, lambda: restart_counts.update(counts))))
    recorder = Recorder()
    if between is not None:
        recorder.on_state["backoff"] = between
    settings = dict(checkpoint_dir=str(ckpt), state_dir=str(tmp_path / "state"), metrics_port=0, poll_interval=0.005,
                    backoff_initial=0.01, backoff_max=0.02, backoff_jitter=0.0, heartbeat_timeout=0.3,
                    startup_timeout=0.3, warm_launcher=False, kill_grace=3.0, stop_grace=5.0)
    settings.update(cfg)
    sup = Supervisor(SupervisorConfig(**settings), ["train"], observer=recorder, processes=layer)
    sup.kernel_log = None  # never the host's kernel log
    assert sup.run().exit_code == 0 and len(layer.jobs) == 2
    return restart_counts, layer


def test_a_step_changed_between_deciding_and_preparing_is_verified_again(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's file of step 10 is rewritten in place during the backoff (same size, other bytes): preparing hashes
    it again, finds step 10 torn and resumes from step 5; rank 0's file, unchanged, is not hashed twice."""
    def corrupt() -> None:
        path = tmp_path / "ckpt" / STEP_10[1]
        path.write_bytes(bytes(len(path.read_bytes())))

    counts, layer = restart(tmp_path, monkeypatch, between=corrupt)
    assert counts == Counter({STEP_10[0]: 1, STEP_10[1]: 2, STEP_5[0]: 1, STEP_5[1]: 1})
    assert layer.jobs[1].env["RLSUP_RESUME_STEP"] == "5"


def test_a_checksum_is_reused_only_for_a_file_unchanged_and_not_just_written(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """An unchanged file is hashed once; one rewritten in place with its old mtime put back is hashed again (its
    ctime moved), and so is one last written as its hash began (an in-place rewrite could keep its timestamp: its
    mtime is set half a second ahead here, so the rule holds however late the hash starts on a busy machine)."""
    old, new = saved_step(tmp_path, 3, range(1), 1), saved_step(tmp_path, 4, range(1), 1, age_s=-0.5)
    known, counts = KnownDigests(), count_hashes(monkeypatch)
    for _ in range(2):
        assert verify_step_dir(old, known=known).valid and verify_step_dir(new, known=known).valid
    assert counts == Counter({"step_000000003/rank_00000.pt": 1, "step_000000004/rank_00000.pt": 2})
    path = old / "rank_00000.pt"
    st = path.stat()
    path.write_bytes(bytes(st.st_size))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    result = verify_step_dir(old, known=known)
    assert not result.valid and "checksum mismatch" in result.reason
    assert counts["step_000000003/rank_00000.pt"] == 2
