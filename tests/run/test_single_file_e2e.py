"""The end-to-end half of test_single_file.py (real processes, or waits on real time): single-file checkpoints
(issue 28): completeness from the format alone, versions kept aside and put back, torn newest checkpoints
quarantined, in process with real writers (torch.save, safetensors, pickle)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from supervisor import layouts
from supervisor.run.quarantine import quarantine_torn, quarantined

from hf_builders import hf_step
from test_single_file import _state, _versions, _FORKS, _COUNTING, _count_fork






def test_quarantine_moves_a_torn_newest_hf_step_aside_and_hf_then_picks_the_valid_one(tmp_path: Path) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    hf_step(tmp_path, 4)
    torn = hf_step(tmp_path, 8)
    weights = next(p for p in torn.rglob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    assert get_last_checkpoint(str(tmp_path)).endswith("checkpoint-8")  # HF alone would load the torn one
    (moved,) = quarantine_torn(tmp_path)
    assert moved.source == torn and moved.target.exists() and not torn.exists()
    assert moved.target.name.startswith("checkpoint-8.rlsup-invalid-")
    assert get_last_checkpoint(str(tmp_path)).endswith("checkpoint-4")
    assert layouts.latest_valid(tmp_path).step == 4
    assert quarantined(tmp_path) == [moved.target]
    assert quarantine_torn(tmp_path) == []  # the valid newest is never moved


def test_a_background_pass_stuck_in_the_directory_never_holds_the_run_loops_calls(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The background pass's child stuck (as in a mount that stopped answering: no byte moves): the run loop's
    calls (the check after an attempt, a restore, the listing) each come back with "nothing" within the call
    deadline, never blocked on the pass's lock; once the child answers, they read the directory again."""
    import threading
    import time

    from supervisor.run import file_versions
    from supervisor.bounded_calls import child_pids
    from support.waits import wait_for

    monkeypatch.setattr(file_versions, "CALL_DEADLINE_S", 0.5)
    torch.save(_state(1), tmp_path / "ckpt.pt")
    release = tmp_path / "release"
    versions = _versions(tmp_path)
    versions._calls.deadline_s = 0.5
    before = child_pids()

    def stuck() -> int:
        while not release.exists():
            time.sleep(0.05)
        return 0

    versions._observe = stuck  # type: ignore[method-assign]  # what the pass's child runs
    versions.start()
    try:
        wait_for(lambda: child_pids() - before, 10, "the background pass to fork")
        answers: list[object] = []

        def run_loop() -> None:
            answers.extend([versions.observe(), versions.restore(), versions.left_torn(), versions.tracked()])

        thread = threading.Thread(target=run_loop, daemon=True)
        thread.start()
        thread.join(30)
        assert not thread.is_alive(), "the run loop's calls waited on the stuck pass"
        assert answers == [0, [], [], []]
    finally:
        release.touch()
        versions.stop()
    wait_for(lambda: versions.tracked() == [tmp_path / "ckpt.pt"], 20, "the directory read again once it answers")






os.register_at_fork(before=_count_fork)


def test_a_directory_with_nothing_to_keep_costs_no_fork_per_pass_and_a_save_still_wakes_one(tmp_path: Path) -> None:
    """A pass that found nothing to keep (no single file; likewise another layout's directory): the next runs
    when a watched save wakes it (or IDLE_RECHECK_S later), not a forked child twice a second for nothing."""
    import threading

    from supervisor.run import file_versions
    from support.waits import wait_for

    versions = _versions(tmp_path)
    versions.start()
    try:
        wait_for(lambda: versions._idle_since is not None, 20, "the first pass to find nothing to keep")
        _COUNTING.append(True)
        try:
            threading.Event().wait(4 * file_versions.PASS_INTERVAL_S)  # a window of four pass intervals
        finally:
            _COUNTING.clear()
        assert not _FORKS, f"{len(_FORKS)} passes forked in a directory with nothing to keep"
        torch.save(_state(1), tmp_path / "ckpt.pt")  # its close wakes a pass (watchdog), long before the recheck
        wait_for(lambda: versions.kept == 1, file_versions.IDLE_RECHECK_S - 1, "the save to wake a pass")
    finally:
        versions.stop()
