"""Killed at random moments (mid-save included) and resumed under `rlsup run`: bit-identical weights."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, clean_env, incidents, job_subdir, start_rlsup, wait_for
from trainer_hooks.heartbeat import read_record
from rlsup_format.manifest import list_step_dirs, verify_step_dir
from rlsup_format.names import Kind, parse_reserved

TRAIN = str(ROOT / "examples" / "train_tiny.py")
PY = sys.executable
STEPS = 30
TRAIN_ARGS = ["--steps", str(STEPS), "--checkpoint-every", "3", "--step-time", "0.03", "--ballast-mb", "24",
              "--keep-last", "2"]


def launcher(world: int) -> list[str]:
    if world == 1:
        return [PY, TRAIN]
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), TRAIN]


def reference_weights(tmp: Path, world: int) -> dict[str, torch.Tensor]:
    out = tmp / "reference.pt"
    subprocess.run([*launcher(world), *TRAIN_ARGS, "--checkpoint-dir", str(tmp / "ref_ckpt"), "--out", str(out)],
                   env=clean_env(), check=True, capture_output=True, timeout=300)
    return torch.load(out, weights_only=True)


def rank_pids(hb_dir: Path) -> dict[int, int]:
    pids = {}
    for path in hb_dir.glob("rank_*.hb"):
        rec = read_record(path)
        if rec is not None and rec.beat_ns:
            pids[rec.rank] = rec.pid
    return pids


def staging_pid(ckpt: Path, live: set[int]) -> int | None:
    """pid of a live rank between writing its shard and its manifest (its staging dir exists).

    Staging dirs of ranks killed earlier stay until a later save cleans them: only ``live`` pids count.
    """
    try:
        for step_dir in ckpt.iterdir():
            for entry in os.scandir(step_dir):
                res = parse_reserved(entry.name)
                if res is not None and res.kind is Kind.STAGING and res.label.startswith("rank_") and res.pid in live:
                    return res.pid
    except (FileNotFoundError, NotADirectoryError):
        pass
    return None


@pytest.mark.parametrize("world", [1, 2])
def test_killed_runs_resume_bit_identical(workdir: Path, world: int) -> None:
    ref = reference_weights(workdir, world)
    out = workdir / "final.pt"
    ckpt = workdir / "checkpoints"
    proc = start_rlsup(["run", "--backoff-initial", "0.05", "--backoff-max", "0.1", "--max-restarts", "10",
                        "--heartbeat-timeout", "60", "--", *launcher(world), *TRAIN_ARGS, "--out", str(out)], workdir)
    rng = random.Random(20261123 + world)
    modes = ["mid_save", "random", "mid_save"]
    try:
        for attempt, mode in enumerate(modes):
            hb = workdir / ".rlsup" / "attempts" / f"attempt_{attempt:04d}" / "heartbeats"
            pids = wait_for(lambda: (p := rank_pids(hb)) and len(p) == world and p, 120,
                            f"all ranks heartbeating in attempt {attempt}")
            if mode == "mid_save":
                live = set(pids.values())
                victim = wait_for(lambda: staging_pid(ckpt, live), 60, "a rank inside a save", interval=0.0005)
            else:
                time.sleep(rng.uniform(0.05, 0.5))  # a random moment of training (the kill is the event)
                victim = pids[rng.randrange(world)]
            os.kill(victim, signal.SIGKILL)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-4000:]
    inc = incidents(workdir / ".rlsup")
    assert len(inc) == len(modes), [i["reason"] for i in inc]
    assert all(i["action"] == "restart" for i in inc)
    final = torch.load(out, weights_only=True)
    assert final.keys() == ref.keys()
    for name in ref:
        assert torch.equal(final[name], ref[name]), f"{name} differs from the uninterrupted run"


def test_wiped_local_dir_resumes_from_persistent_tier_under_rlsup(workdir: Path) -> None:
    """The whole node is lost (rlsup SIGKILLed, local checkpoints gone); a new rlsup resumes from the
    persistent tier and the run ends bit-identical to an uninterrupted one."""
    train = ["--steps", "30", "--checkpoint-every", "3", "--step-time", "0.15", "--ballast-mb", "4", "--keep-last", "2"]
    ref_out = workdir / "reference.pt"
    subprocess.run([*launcher(1), *train, "--step-time", "0", "--checkpoint-dir", str(workdir / "ref"),
                    "--out", str(ref_out)], env=clean_env(), check=True, capture_output=True, timeout=300)
    ref = torch.load(ref_out, weights_only=True)
    out, ckpt, persistent = workdir / "final.pt", workdir / "checkpoints", workdir / "shared-fs"
    args = ["run", "--backoff-initial", "0.05", "--persistent-dir", str(persistent),
            "--replication-scan-interval", "0.2", "--", *launcher(1), *train, "--out", str(out)]

    def persisted() -> int:
        return max((s for s, d in list_step_dirs(job_subdir(persistent)) if verify_step_dir(d).valid), default=0)

    proc = start_rlsup(args, workdir)
    try:
        wait_for(lambda: persisted() >= 6, 120, "a step >= 6 copied to the persistent tier")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    saved = persisted()
    shutil.rmtree(ckpt)
    proc = start_rlsup(args, workdir)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    assert incidents(workdir / ".rlsup")[-1]["reason"] == "supervisor_lost"
    state = json.loads((workdir / ".rlsup" / "state.json").read_text())
    assert state["resume_tier"] == "persistent" and state["resume_step"] >= saved, (saved, state)
    final = torch.load(out, weights_only=True)
    for name in ref:
        assert torch.equal(final[name], ref[name]), f"{name} differs from the uninterrupted run"
