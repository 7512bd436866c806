"""Megatron-Core / Megatron-Bridge iter_N trees written by megatron-core's dist_checkpointing.save."""

from __future__ import annotations

from pathlib import Path

from layout_builders import megatron_iter

import test_layouts_megatron as fast_tier

template = fast_tier.template  # the fast tier's fixture


def test_run_with_no_megatron_tracker_claims_no_resume(tmp_path: Path) -> None:
    """rlsup run around such a directory: no tracker written, and no resume claimed (the trainer will
    start fresh), so the job is told to start fresh too."""
    import sys

    from support.procs import run_rlsup

    ckpt = tmp_path / "ckpt"
    megatron_iter(ckpt, 10, tracker=False)
    r = run_rlsup(["run", "--checkpoint-dir", str(ckpt), "--checkpoint-layout", "megatron", "--repair-tracker",
                   "--", sys.executable, "-c", "import os; print('RESUME=' + os.environ['RLSUP_RESUME_DIR'])"],
                  tmp_path)
    assert r.returncode == 0, r.stderr
    assert "tracker not created" in r.stderr and "starts fresh" in r.stderr, r.stderr
    assert "RESUME=\n" in r.stdout and "from step 10" not in r.stderr
    assert not (ckpt / "latest_checkpointed_iteration.txt").exists()
