"""The end-to-end half of test_layouts_megatron.py (real processes, or waits on real time): megatron-Core /
Megatron-Bridge iter_N trees written by megatron-core's dist_checkpointing.save."""

from __future__ import annotations



from pathlib import Path

from layout_builders import megatron_iter

import test_layouts_megatron as fast_tier
import pytest
import layout_builders as lb
from layout_builders import largest, truncate
from supervisor import layouts
template = fast_tier.template
template = fast_tier.template

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


def test_template_files_are_what_mcore_writes(template: Path) -> None:
    names = {p.name for p in template.iterdir()}
    assert {"metadata.json", "common.pt", ".metadata"} <= names and any(n.endswith(".distcp") for n in names)
    if not lb.MCORE_REAL:
        pytest.skip("megatron-core not installed: tree built from DCP + MCore's metadata.json/common.pt")


def test_core_complete_partial_truncated(tmp_path: Path) -> None:
    megatron_iter(tmp_path, 100)
    i200 = megatron_iter(tmp_path, 200)
    i300 = megatron_iter(tmp_path, 300)
    i400 = megatron_iter(tmp_path, 400)
    (i200 / "metadata.json").unlink()           # killed before MCore's last file
    truncate(largest(i300, "*.distcp"), 0.5)   # shard cut short
    truncate(i400 / "common.pt", 0.5)
    assert layouts.detect_layout(tmp_path) == "megatron"
    recs = {r.step: r for r in layouts.scan(tmp_path)}
    assert recs[100].valid
    assert "metadata.json missing" in recs[200].reason
    assert "truncated" in recs[300].reason
    assert "common.pt" in recs[400].reason
    assert layouts.latest_valid(tmp_path).step == 100
    st = layouts.tracker_status(tmp_path)
    assert st.step == 400 and st.step_valid is False and st.newest_valid_step == 100

