"""The end-to-end half of test_layouts_deepspeed.py (real processes, or waits on real time): deepSpeed
``save_checkpoint`` trees (and OpenRLHF's ``_actor``/``_critic`` form), written by the real deepspeed on CPU and
SIGKILLed between its files: rlsup picks a complete tag, DeepSpeed's ``latest`` sometimes names a broken one, and
``repair_tracker`` points ``latest`` back at the chosen tag."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import kill_matrix as km
from support.env import JOBS, clean_env
from support.ports import free_ports
from support.procs import rlsup_cmd
from deepspeed_builders import (copy_tree, deepspeed_would_load, openrlhf_retention, truncate_half)

from supervisor import layouts
from supervisor.layouts import deepspeed as dsl

JOB = JOBS / "deepspeed_save_job.py"
# the real runs take ~45 s on an idle 2-core machine; a busy one stretches the module fixture's setup
pytestmark = pytest.mark.timeout(600)
OPTIM1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


@dataclass
class RealRuns:
    """The trees the real writer left: complete, killed at each distinct event of save B, rank-race."""

    template: Path
    b_events: list[km.FileEvent]
    killed: dict[int, Path]
    race: Path
    resumed: tuple[Path, subprocess.CompletedProcess]


def _cmd(root: Path) -> list[str]:
    return [km.python(), str(JOB), str(root), "2", "1"]


def _kill_points(b_events: list[km.FileEvent], root: Path) -> list[int]:
    """The first event of each distinct kind of save B: tag mkdir, model states, optim shard, recovery
    script, latest (the exist_ok mkdir of the existing save dir changes nothing on disk: skipped)."""
    seen, points = set(), []
    for e in b_events:
        kind = (e.event, re.sub(r"\d+", "N", re.sub(r"zero_to_\w+", "script", Path(e.path).name)))
        if kind not in seen and Path(e.path) != root.resolve():
            seen.add(kind)
            points.append(e.index)
    return points


def _killed(root: Path, k: int, port: int) -> Path:
    km.run_killed_at(_cmd(root), root, k, env=clean_env(RLSUP_TEST_PORT=str(port)), timeout=300)
    return root


def _race(root: Path, port: int) -> Path:
    cmd = [km.python(), "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(JOB), str(root), "2", "1"]
    proc = subprocess.run(cmd, env=clean_env(RLSUP_TEST_DS_RANK_DIES="1"), timeout=300, capture_output=True,
                          text=True)
    assert proc.returncode != 0, f"rank 1 was meant to die:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return root


def _resume_under_rlsup(template: Path, work: Path, port: int) -> tuple[Path, subprocess.CompletedProcess]:
    """`latest` names a tag with a torn optimizer shard; the job only calls ``engine.load_checkpoint(dir)``
    under ``rlsup run --repair-tracker true``."""
    from support.procs import run_rlsup

    ckpt = copy_tree(template, work / "ckpt")
    truncate_half(ckpt / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert deepspeed_would_load(ckpt) == "global_step2"
    r = run_rlsup(["run", "--backoff-initial", "0.05", "--kill-grace", "2", "--checkpoint-dir", str(ckpt),
                   "--repair-tracker", "true", "--", km.python(), str(JOB), str(ckpt), "0", "1"],
                  work, timeout=300, RLSUP_TEST_DS_LOAD="1", RLSUP_TEST_PORT=str(port))
    return ckpt, r


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> RealRuns:
    pytest.importorskip("deepspeed")
    base = tmp_path_factory.mktemp("ds")
    ports = free_ports(16)
    with ThreadPoolExecutor(2) as pool:
        race = pool.submit(_race, base / "race", ports.pop())
        events, _ = km.record_events(_cmd(base / "record"), base / "record",
                                     env=clean_env(RLSUP_TEST_PORT=str(ports.pop())), timeout=300)
        first_latest = next(e.index for e in events if e.path.endswith("/latest"))
        b_events = [e for e in events if e.index > first_latest]
        points = _kill_points(b_events, base / "record")
        runs = {k: pool.submit(_killed, base / f"kill_{k}", k, ports.pop()) for k in points}
        resumed = pool.submit(_resume_under_rlsup, base / "record", base / "resume", ports.pop())
        killed = {k: f.result() for k, f in runs.items()}
        return RealRuns(base / "record", b_events, killed, race.result(), resumed.result())


def _b_tag_files(real: RealRuns) -> dict[int, str]:
    """Event index -> name of each file save B writes into global_step2/."""
    return {e.index: Path(e.path).name for e in real.b_events
            if e.event == "open" and Path(e.path).parent.name == "global_step2"}


# ------------------------------------------------------------------ the real writer


def test_real_save_is_read_as_deepspeed_wrote_it(real: RealRuns) -> None:
    root = real.template
    assert layouts.detect_layout(root) == "deepspeed"
    assert [(r.step, r.valid) for r in layouts.scan(root)] == [(1, True), (2, True)]
    meta, err = dsl.read_meta(root / "global_step2" / "mp_rank_00_model_states.pt")
    assert err is None and (meta.dp_world_size, meta.mp_world_size, meta.zero_stage, meta.global_steps) == (1, 1, 1, 2)
    assert layouts.tracker_status(root).ok and deepspeed_would_load(root) == "global_step2"
    assert sorted(_b_tag_files(real).values()) == ["mp_rank_00_model_states.pt",
                                                   "zero_pp_rank_0_mp_rank_00_optim_states.pt"]


def test_kill_matrix_picks_a_complete_tag(real: RealRuns) -> None:
    """Killed before each distinct event of save B: B only when every file it writes is there."""
    last_tag_file = max(_b_tag_files(real))
    assert len(real.killed) == 5, real.killed
    for k, root in sorted(real.killed.items()):
        rec = layouts.latest_valid(root)
        want = 2 if k > last_tag_file else 1
        assert rec is not None and rec.valid and rec.step == want, (k, rec)
        for r in layouts.scan(root):  # every step verifies without raising, the broken one with a reason
            assert r.valid or r.reason
        # single process: rank 0 writes `latest` after its own files, so it names step 1 until the end
        assert deepspeed_would_load(root) == "global_step1", k


def test_half_written_files(real: RealRuns, tmp_path: Path) -> None:
    """A kill inside the write of event k-1's file: B must not be chosen when that file is one of its own."""
    tag_files = _b_tag_files(real)
    cut = 0
    for k in sorted(real.killed):
        written = [i for i in tag_files if i < k]
        if not written:
            continue
        name = tag_files[max(written)]  # the last file of B the process had created when it was killed
        root = copy_tree(real.killed[k], tmp_path / f"half_{k}")
        truncate_half(root / "global_step2" / name)
        rec = layouts.latest_valid(root)
        assert rec.step == 1, (k, rec)
        bad = layouts.verify_path(root / "global_step2")
        assert not bad.valid and name in bad.reason and "truncated" in bad.reason, bad.reason
        cut += 1
    assert cut >= 3


@pytest.mark.parametrize("cut", ["half", "empty"])
def test_torn_latest_is_where_deepspeed_picks_wrong(real: RealRuns, tmp_path: Path, cut: str) -> None:
    """Rank 0 killed inside its in-place open('w') of `latest`: DeepSpeed's own resume names no usable tag."""
    root = copy_tree(real.template, tmp_path / "run")
    if cut == "half":
        truncate_half(root / "latest")
    else:
        os.truncate(root / "latest", 0)
    would = deepspeed_would_load(root)
    assert would in ("global", ""), would
    assert not (would and layouts.verify_path(root / would).valid)
    assert layouts.latest_valid(root).step == 2
    st = layouts.tracker_status(root)
    assert st.error and not st.ok and st.newest_valid_step == 2, st
    path = layouts.repair_tracker(root, 2)
    assert path == root / "latest" and deepspeed_would_load(root) == "global_step2"
    assert (root / "latest.rlsup-prev").read_bytes() == ("global" if cut == "half" else "").encode()
    assert layouts.tracker_status(root).ok


def test_rank_dies_after_latest_deepspeed_would_resume_broken(real: RealRuns, tmp_path: Path) -> None:
    """2 ranks: rank 0 rewrote `latest` before the final barrier, rank 1 died before its optimizer shard."""
    root = copy_tree(real.race, tmp_path / "race")
    assert deepspeed_would_load(root) == "global_step2"  # DeepSpeed's resume: a tag missing rank 1's shard
    assert not (root / "global_step2" / OPTIM1).exists() and (root / "global_step1" / OPTIM1).exists()
    bad = layouts.verify_path(root / "global_step2")
    assert not bad.valid and OPTIM1 in bad.reason and "dp_world_size 2" in bad.reason, bad.reason
    assert layouts.latest_valid(root).step == 1
    st = layouts.tracker_status(root)
    assert (st.step, st.step_valid, st.ok, st.newest_valid_step) == (2, False, False, 1)
    with pytest.raises(ValueError, match="not valid"):
        layouts.repair_tracker(root, 2)
    layouts.repair_tracker(root, 1)
    assert deepspeed_would_load(root) == "global_step1"
    assert (root / "latest.rlsup-prev").read_text() == "global_step2"
    assert layouts.tracker_status(root).ok


def test_missing_rank_shard_of_a_finished_save(real: RealRuns, tmp_path: Path) -> None:
    """DeepSpeed #7546: a per-rank shard gone from a tag `latest` names."""
    root = copy_tree(real.race, tmp_path / "race")
    (root / "global_step1" / OPTIM1).unlink()
    assert layouts.latest_valid(root) is None
    out = subprocess.run(rlsup_cmd("checkpoints", "verify", str(root / "global_step1")), env=clean_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and OPTIM1 in out.stdout + out.stderr


def test_cli_latest_repairs_latest(real: RealRuns, tmp_path: Path) -> None:
    root = copy_tree(real.race, tmp_path / "race")
    out = subprocess.run(rlsup_cmd("checkpoints", "latest", "--repair-tracker", str(root)), env=clean_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(root / "global_step1")
    assert deepspeed_would_load(root) == "global_step1"


# ------------------------------------------------------------------ OpenRLHF: _actor/ and _critic/


def _openrlhf(real: RealRuns, run: Path) -> Path:
    for role in ("_actor", "_critic"):
        copy_tree(real.template, run / role)
    return run


def test_openrlhf_step_needs_every_role(real: RealRuns, tmp_path: Path) -> None:
    run = _openrlhf(real, tmp_path / "ckpt")
    assert layouts.detect_layout(run) == "deepspeed"
    rec = layouts.latest_valid(run)
    assert rec.step == 2 and rec.path == run / "_actor" / "global_step2"
    truncate_half(run / "_critic" / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    bad = layouts.verify_path(run / "_actor" / "global_step2")
    assert not bad.valid and bad.reason.startswith("_critic/global_step2:"), bad.reason
    assert layouts.latest_valid(run).step == 1
    st = layouts.tracker_status(run)
    assert (st.step, st.step_valid, st.ok) == (2, False, False)
    layouts.repair_tracker(run, 1)
    for role in ("_actor", "_critic"):
        assert deepspeed_would_load(run / role) == "global_step1"
        assert (run / role / "latest.rlsup-prev").read_text() == "global_step2"
    assert layouts.tracker_status(run).ok


def test_openrlhf_killed_between_actor_and_critic(real: RealRuns, tmp_path: Path) -> None:
    run = _openrlhf(real, tmp_path / "ckpt")
    import shutil

    shutil.rmtree(run / "_critic" / "global_step2")
    (run / "_critic" / "latest").write_text("global_step1")
    rec = layouts.verify_path(run / "_actor" / "global_step2")
    assert not rec.valid and "_critic/global_step2" in rec.reason and "missing" in rec.reason
    st = layouts.tracker_status(run)
    assert st.error and "roles disagree" in st.error
    assert layouts.latest_valid(run).step == 1


def test_openrlhf_retention_deletes_the_only_complete_step(real: RealRuns, tmp_path: Path) -> None:
    """save_ckpt deletes the oldest dir by mtime *before* saving: after a killed save, the next save of a
    resumed run deletes the one complete step (rlsup cannot prevent it; the docs say max_ckpt_num >= 3)."""
    actor = copy_tree(real.killed[max(_b_tag_files(real))], tmp_path / "ckpt" / "_actor")
    assert layouts.latest_valid(actor.parent).step == 1
    assert openrlhf_retention(actor, max_num=2) == ["global_step1"]
    assert layouts.latest_valid(actor.parent) is None
    assert deepspeed_would_load(actor) == "global_step1" and not (actor / "global_step1").exists()


def test_openrlhf_retention_by_mtime_can_delete_the_newest(real: RealRuns, tmp_path: Path) -> None:
    actor = copy_tree(real.template, tmp_path / "ckpt" / "_actor")
    old = (actor / "global_step1").stat().st_mtime
    os.utime(actor / "global_step2", (old - 60, old - 60))  # e.g. restored by a copy that kept old times
    assert openrlhf_retention(actor, max_num=2) == ["global_step2"]
    assert layouts.latest_valid(actor.parent).step == 1
    assert not layouts.tracker_status(actor.parent).ok  # latest names the deleted global_step2


# ------------------------------------------------------------------ built from the 0.19.8 source


def test_layout_code_imports_no_trainer_library(real: RealRuns) -> None:
    code = ("import sys; from supervisor import layouts; layouts.scan(sys.argv[1]); layouts.tracker_status(sys.argv[1]);"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('deepspeed', 'torch')]; assert not bad, bad[:5]")
    subprocess.run([sys.executable, "-c", code, str(real.race)], env=clean_env(), check=True, timeout=60)


def test_rlsup_run_repairs_latest_so_deepspeed_resumes_the_chosen_tag(real: RealRuns) -> None:
    """End to end: before the attempt rlsup points `latest` at global_step1, and the job's plain
    ``engine.load_checkpoint(dir)`` (tag=None) loads that instead of the broken global_step2."""
    ckpt, r = real.resumed
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    loaded = ckpt / "global_step1" / "mp_rank_00_model_states.pt"
    assert f"loaded {loaded} global_steps=1 resume_step=1" in r.stdout, r.stdout[-3000:]
    assert (ckpt / "latest.rlsup-prev").read_text() == "global_step2"
    assert deepspeed_would_load(ckpt) == "global_step1"
