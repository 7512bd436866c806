"""The end-to-end half of test_layouts_nemo_rl.py (real processes, or waits on real time): neMo-RL ``step_N`` trees
written the way NeMo-RL's CheckpointManager and GRPO loop write them (tests/source_builders.py, from
nemo_rl/utils/checkpoint.py @01e9028), with real DCP and torch.save writers, and a mid-save kill matrix: every
prefix of a save, real SIGKILLs agreeing with in-process stops."""

from __future__ import annotations

from pathlib import Path

import kill_matrix as km
import source_builders as sb

from supervisor import layouts


def test_real_sigkill_leaves_what_the_in_process_stop_leaves(tmp_path: Path) -> None:
    rec_root = tmp_path / "rec"
    cmd = [km.python(), str(Path(sb.__file__)), "nemo-rl"]
    events, _ = km.record_events([*cmd, str(rec_root), "1", "2"], rec_root, timeout=120)
    inproc = sb.run_ops(tmp_path / "ip", lambda: [sb.nemo_rl_save(tmp_path / "ip", s) for s in (1, 2)])
    assert [e.event for e in events] == [e for e, _ in inproc.events]
    k = len(events)  # before step 2's rename
    killed = tmp_path / "killed"
    km.run_killed_at([*cmd, str(killed), "1", "2"], killed, k, timeout=120)
    stopped = tmp_path / "stopped"
    sb.run_ops(stopped, lambda: [sb.nemo_rl_save(stopped, s) for s in (1, 2)], stop_at=k)
    assert sb.tree_names(killed) == sb.tree_names(stopped)
    assert layouts.latest_valid(killed).step == layouts.latest_valid(stopped).step == 1


def test_rlsup_run_resumes_from_the_newest_complete_step(tmp_path: Path) -> None:
    """Under ``rlsup run --checkpoint-dir``: attempt 0 saves step 1 and is SIGKILLed inside step 2's save;
    attempt 1 gets RLSUP_RESUME_DIR/RLSUP_RESUME_STEP of the newest complete step."""
    from support.procs import run_rlsup

    ckpt = tmp_path / "ckpt"
    job = sb.job_script(tmp_path / "job.py", "nemo-rl")
    fast = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2", "--max-restarts", "3"]
    r = run_rlsup(["run", *fast, "--checkpoint-dir", str(ckpt), "--", km.python(), str(job)], tmp_path, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "RESUME 1 step_1" in r.stdout, r.stdout[-3000:]
    assert sb.nemo_rl_latest(ckpt) == ckpt / "step_1"
