"""The end-to-end half of test_layouts_torchtitan.py (real processes, or waits on real time): torchtitan ``step-N``
trees written the way torchtitan's CheckpointManager writes them (tests/source_builders.py, from
torchtitan/components/checkpointer/dcp.py @b5bcd76), with real DCP saves, and a mid-save kill matrix: every prefix
of a save, real SIGKILLs agreeing with the in-process stops."""

from __future__ import annotations

from pathlib import Path

import kill_matrix as km
import source_builders as sb

from supervisor import layouts


def test_real_sigkill_leaves_what_the_in_process_stop_leaves(tmp_path: Path) -> None:
    """tests/kill_matrix.py SIGKILLs `source_builders.py torchtitan ROOT 10 20` before event k; the tree
    must equal the in-process builder stopped before its k-th file operation."""
    rec_root = tmp_path / "rec"
    cmd = [km.python(), str(Path(sb.__file__)), "torchtitan", str(rec_root), "10", "20"]
    events, _ = km.record_events(cmd, rec_root, timeout=120)
    inproc = sb.run_ops(tmp_path / "ip", lambda: [sb.torchtitan_save(tmp_path / "ip", s) for s in (10, 20)])
    assert [e.event for e in events] == [e for e, _ in inproc.events]
    for k in (len(events) - 1,):  # before step-20's .metadata.tmp: its shard written, no .metadata
        killed = tmp_path / f"kill{k}"
        km.run_killed_at([km.python(), *cmd[1:3], str(killed), "10", "20"], killed, k, timeout=120)
        stopped = tmp_path / f"stop{k}"
        sb.run_ops(stopped, lambda: [sb.torchtitan_save(stopped, s) for s in (10, 20)], stop_at=k)
        assert sb.tree_names(killed) == sb.tree_names(stopped)
        assert layouts.latest_valid(killed).step == layouts.latest_valid(stopped).step == 10


def test_rlsup_run_resumes_from_the_newest_complete_step(tmp_path: Path) -> None:
    """Under ``rlsup run --checkpoint-dir``: attempt 0 saves step 1 and is SIGKILLed inside step 2's save;
    attempt 1 gets RLSUP_RESUME_DIR/RLSUP_RESUME_STEP of the newest complete step."""
    from support.procs import run_rlsup

    ckpt = tmp_path / "ckpt"
    job = sb.job_script(tmp_path / "job.py", "torchtitan")
    fast = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2", "--max-restarts", "3"]
    r = run_rlsup(["run", *fast, "--checkpoint-dir", str(ckpt), "--", km.python(), str(job)], tmp_path, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "RESUME 1 step-1" in r.stdout, r.stdout[-3000:]
    assert sb.torchtitan_find_load_step(ckpt) == 1
