"""Done-when test of issue 18 for Lightning: a real Lightning run under ``rlsup run``, its training
process SIGKILLed at seeded random moments and right when a new checkpoint file appears (between
the step file and last.ckpt: mid-save), reaches its last step, resumes only from complete
checkpoints, and ends with exactly the weights of an uninterrupted run.

Lightning's resume is exact here because every checkpoint falls on an epoch boundary (8 batches per
epoch, a checkpoint every 8 steps, unshuffled data, ``seed_everything``, ``deterministic=True``);
resuming mid-epoch is not exact in Lightning 2.6.6 with a plain DataLoader (the epoch's batches are
replayed from its start), checked once by hand without rlsup.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import lightning_builders as lb
from support.env import clean_env
from support.procs import rlsup_cmd
from support.waits import wait_for
from supervisor.layouts import lightning as lt

FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2"]
TRAIN = ["--max-steps", "32", "--every", "8", "--save-last", "link", "--slow", "0.12"]


def _starts(log: Path) -> list[list[str]]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [ln.split() for ln in lines if ln.startswith("start ")]


def _ckpt_names(d: Path) -> set[str]:
    try:
        return {p.name for p in d.iterdir() if p.name.endswith(".ckpt") and not p.name.startswith("last")}
    except OSError:
        return set()


def _kill_attempt(log: Path, ckpt: Path, n: int, mode: str, rng: random.Random) -> tuple[str, int]:
    """Wait for attempt ``n`` to start, then SIGKILL its training process: at a random moment, or the
    instant a new checkpoint file appears (before last.ckpt is re-linked). Returns what was done and
    the step the next attempt must resume from at least (-1: any)."""
    start = wait_for(lambda: _starts(log)[n] if len(_starts(log)) > n else None, 240, f"attempt {n} to start")
    pid = int(start[1])
    if mode == "new-file":
        before = _ckpt_names(ckpt)
        new = wait_for(lambda: _ckpt_names(ckpt) - before or None, 240, "a new checkpoint file", interval=0.002)
        os.kill(pid, signal.SIGKILL)
        last = lb.lightning_last_pick(ckpt)
        step = max(lt.step_from_name(Path(p)) or -1 for p in new)
        return f"attempt {n}: killed as {sorted(new)} appeared (last.ckpt -> {last and last.resolve().name})", step
    delay = rng.uniform(0.5, 4.0)
    deadline = time.monotonic() + delay
    wait_for(lambda: time.monotonic() >= deadline, delay + 5, "the random kill moment", interval=0.02)
    os.kill(pid, signal.SIGKILL)
    return f"attempt {n}: killed {delay:.2f}s after start", -1


@pytest.mark.timeout(600)
def test_lightning_under_rlsup_survives_kills_with_exact_weights(tmp_path: Path) -> None:
    ckpt, log = tmp_path / "ckpts", tmp_path / "attempts.log"
    assert lb.lightning_last_pick(tmp_path) is None  # imports Lightning here now, not between two kills
    ref_dir = tmp_path / "reference"
    env = clean_env()
    reference = subprocess.Popen([*lb.job_cmd(ref_dir / "ckpts", *TRAIN), "--out", str(ref_dir / "final.pt")],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    job = [*lb.job_cmd(ckpt, *TRAIN), "--out", str(tmp_path / "final.pt"), "--log", str(log)]
    proc = subprocess.Popen(rlsup_cmd("run", *FAST, "--checkpoint-dir", str(ckpt), "--max-restarts", "10",
                                      "--max-no-progress-attempts", "10", "--", *job),
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rng = random.Random(18)
    done: list[str] = []
    floors: list[int] = []
    try:
        for n, mode in enumerate(["new-file", "random", "new-file"]):
            what, floor = _kill_attempt(log, ckpt, n, mode, rng)
            done.append(what)
            floors.append(floor)
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, (done, out[-4000:])
    assert reference.wait(timeout=400) == 0
    lines = log.read_text().splitlines()
    assert lines[-1] == "done 32", (done, lines)
    starts = _starts(log)
    assert len(starts) == 4, (done, lines)
    resumed = [(int(s[2]), Path(s[3])) for s in starts if len(s) > 3]
    assert resumed, (done, lines)
    for step, path in resumed:  # every resume: a complete named checkpoint at an epoch boundary
        assert step % 8 == 0 and lt.step_from_name(path) == step and not lt.is_last(path), (done, lines)
        assert lb.lightning_can_load(path), path
    for n, floor in enumerate(floors):  # a step file that appeared is complete (renamed into place): used
        assert int(starts[n + 1][2]) >= floor, (done, lines)
    steps = [s for s, _ in resumed]
    assert steps == sorted(steps), (done, lines)
    final, expected = torch.load(tmp_path / "final.pt"), torch.load(ref_dir / "final.pt")
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in expected), (done, lines)
    print("\n".join(done + lines))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
