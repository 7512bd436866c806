"""The end-to-end half of test_layouts_nemo.py (real processes, or waits on real time): neMo 2 checkpoint trees
written the way NeMo's ModelCheckpoint + MegatronCheckpointIO write them (tests/source_builders.py, from
nemo/lightning/pytorch/callbacks/model_checkpoint.py @8cfedd7), with ``weights/`` from a real megatron-core save,
and a mid-save kill matrix against AutoResume's own pick."""

from __future__ import annotations

import os
from pathlib import Path

import kill_matrix as km
import source_builders as sb

from supervisor import layouts
from supervisor.layouts import nemo
from test_layouts_nemo import B_LAST, B_TOPK
import test_layouts_nemo as fast_tier

mcore_template = fast_tier.mcore_template  # the fast tier's fixture


def test_real_sigkill_leaves_what_the_in_process_stop_leaves(tmp_path: Path) -> None:
    rec_root = tmp_path / "rec"
    cmd = [km.python(), str(Path(sb.__file__)), "nemo"]
    events, _ = km.record_events([*cmd, str(rec_root), "1", "2"], rec_root, timeout=120)
    inproc = sb.run_ops(tmp_path / "ip", lambda: [_save(tmp_path / "ip", s) for s in (1, 2)])
    assert [e.event for e in events] == [e for e, _ in inproc.events]
    k = [i for i, e in enumerate(events, 1) if e.path.endswith(B_LAST + "/weights/metadata.json")][0]
    killed = tmp_path / "killed"
    km.run_killed_at([*cmd, str(killed), "1", "2"], killed, k, timeout=120)
    stopped = tmp_path / "stopped"
    sb.run_ops(stopped, lambda: [_save(stopped, s) for s in (1, 2)], stop_at=k)
    assert sb.tree_names(killed) == sb.tree_names(stopped)
    assert layouts.latest_valid(killed).path.name == layouts.latest_valid(stopped).path.name == B_TOPK


def _save(root: Path, step: int) -> None:
    sb.BUILDERS["nemo"](root, step)


def test_rlsup_run_resumes_from_the_newest_complete_step(tmp_path: Path) -> None:
    """Under ``rlsup run --checkpoint-dir``: attempt 0 saves step 1 and is SIGKILLed inside step 2's save;
    attempt 1 gets RLSUP_RESUME_DIR/RLSUP_RESUME_STEP of the newest complete step."""
    from support.procs import run_rlsup

    ckpt = tmp_path / "ckpt"
    job = sb.job_script(tmp_path / "job.py", "nemo")
    fast = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2", "--max-restarts", "3"]
    template = {sb.MCORE_TEMPLATE_ENV: os.environ[sb.MCORE_TEMPLATE_ENV]}
    r = run_rlsup(["run", *fast, "--checkpoint-dir", str(ckpt), "--", km.python(), str(job)], tmp_path, timeout=180,
                  **template)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"RESUME 2 {B_TOPK}" in r.stdout, r.stdout[-3000:]
    assert sb.nemo_autoresume_pick(ckpt) == ckpt / sb.nemo_name(1, last=True)  # AutoResume would take step 1
    # the killed -last copy and its marker are left exactly where NeMo's next setup() expects them
    assert (ckpt / B_LAST).is_dir() and nemo.marker_of(ckpt / B_LAST).exists()
