"""Issue 18's done-when for HF: a Trainer run under ``rlsup run`` is SIGKILLed at seeded random moments,
including mid-save; it reaches its last step, every resume is from a checkpoint that rlsup's layouts call
complete at load time, and the final weights equal an uninterrupted run's. TRL's SFTTrainer saves through the
same Trainer code; it is killed mid-save and at random moments, with exact final weights, as ``trl sft`` in
tests/thirdparty/test_thirdparty_trainers_e2e.py (one process, and two ranks under torchrun).

HF's own resume is bit-exact here (checked without rlsup: a run resumed from its checkpoint-8 ends with
``torch.equal`` weights): one epoch, so the sampler's permutation comes from the seeded RNG and
``skip_first_batches`` skips the trained batches; dropout 0; optimizer, scheduler and RNG state restored.

Kills: the job's own python process (never rlsup), by three means per run: tests/kill_matrix.py's hook
re-armed per attempt (the job re-execs itself with ``RLSUP_TEST_KILL_AT=K``: a kill before the K-th file
event, inside a save), SIGKILL from the test the moment a new ``checkpoint-N`` directory appears (mid-save),
and SIGKILL at a seeded random step (a few ms after the job logs it: inside the next step, or the save after it;
a fixed delay would land after the end on an idle machine and at the start on a busy one).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support.env import JOBS, clean_env
from support.procs import rlsup_cmd, sigkill
from support.waits import wait_for

import kill_matrix
from supervisor import layouts

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2", "--max-restarts", "20",
        "--max-no-progress-attempts", "0", "--poll-interval", "0.1"]
MAX_STEPS, SAVE_STEPS = 16, 4


@dataclass
class Plan:
    """Per attempt: ("hook", K) kill before file event K; ("new_dir", 0) kill when a step dir appears;
    ("random", f) kill once the fraction f of the steps left is done (seen in the job's log a few ms late,
    so anywhere in the next step or the save after it); attempts not listed run on."""

    kills: dict[int, tuple[str, float]]
    done: list[tuple[int, str, list[tuple[int, bool]]]] = field(default_factory=list)  # attempt, how, steps after


def _events(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip().endswith("}")]


def _step_dirs(root: Path) -> set[str]:
    return {p.name for _, p in layouts.LAYOUTS["hf"].list_steps(root)} if root.exists() else set()


def _external_kill(proc: subprocess.Popen, log: Path, ckpt: Path, attempt: int, how: str, arg: float) -> bool:
    """Wait for ``attempt`` to begin training, then SIGKILL its pid when ``how`` says; False if it ended first."""
    train = wait_for(lambda: next((e for e in _events(log) if e["event"] == "train" and e["attempt"] == str(attempt)),
                                  None) or proc.poll() is not None, 240, f"attempt {attempt} to start training")
    if train is True:
        return False
    before = _step_dirs(ckpt)
    target = min(train["step"] + max(1, round(arg * (MAX_STEPS - train["step"]))), MAX_STEPS - 1)

    def moment() -> bool:
        ev = _events(log)
        if any(e["event"] == "done" for e in ev):
            return True
        if how == "new_dir":
            return bool(_step_dirs(ckpt) - before)
        return any(e["event"] == "step" and e["pid"] == train["pid"] and e["step"] >= target for e in ev)

    wait_for(moment, 240, f"the kill moment of attempt {attempt}", interval=0.003)
    if any(e["event"] == "done" for e in _events(log)):
        return False  # it finished first
    return sigkill(train["pid"])


def _run(job: str, tmp: Path, plan: Plan) -> tuple[list[dict], Path]:
    tmp.mkdir(parents=True, exist_ok=True)
    ckpt, log, final = tmp / "out", tmp / "job.jsonl", tmp / "final.safetensors"
    hooks = ",".join(f"{a}:{int(k)}" for a, (how, k) in plan.kills.items() if how == "hook")
    env = kill_matrix._env(clean_env(HF_JOB_LOG=str(log), HF_JOB_KILL_AT=hooks), ckpt, None, None, None)
    cmd = rlsup_cmd("run", *FAST, "--checkpoint-dir", str(ckpt), "--state-dir", str(tmp / "state"), "--",
                    sys.executable, str(JOBS / job), str(ckpt), "--max-steps", str(MAX_STEPS),
                    "--save-steps", str(SAVE_STEPS), "--final", str(final))
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for attempt in range(max(plan.kills) + 1):
            how, arg = plan.kills.get(attempt, ("none", 0))
            if how in ("new_dir", "random") and _external_kill(proc, log, ckpt, attempt, how, arg):
                plan.done.append((attempt, how, _scan(ckpt)))
            elif how == "hook":
                wait_for(lambda: any(e["attempt"] == str(attempt + 1) for e in _events(log)) or proc.poll() is not None,
                         240, f"attempt {attempt} (killed at its file event {int(arg)}) to be followed")
                plan.done.append((attempt, how, _scan(ckpt)))
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-6000:]
    return _events(log), final


def _scan(ckpt: Path) -> list[tuple[int, bool]]:
    return [(r.step, r.valid) for r in layouts.scan(ckpt)]


def _start_reference(job: str, tmp: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(JOBS / job), str(tmp / "ref-out"), "--max-steps", str(MAX_STEPS),
                             "--save-steps", str(SAVE_STEPS), "--final", str(tmp / "ref.safetensors")],
                            env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _check(job: str, tmp: Path, seed: int) -> None:
    rng = random.Random(seed)
    plan = Plan({0: ("hook", rng.randint(16, 26)), 1: ("new_dir", 0), 2: ("random", rng.uniform(0.05, 0.8))})
    reference = _start_reference(job, tmp)  # alongside: the uninterrupted run the final weights must equal
    events, final = _run(job, tmp / "rlsup", plan)
    done = [e for e in events if e["event"] == "done"]
    assert done and done[-1]["step"] == MAX_STEPS, events
    resumes = [e for e in events if e["event"] == "resume"]
    attempts = {e["attempt"] for e in events if e["event"] == "start"}
    assert len(attempts) >= 3 and len(plan.done) >= 2, (attempts, plan.done)
    # >= 1: a kill before the first complete save restarts fresh (RLSUP_RESUME_DIR=""), and on an idle machine
    # the random-time kill can come after the job finished (it is then not made)
    assert resumes, events
    for r in resumes:  # verified by the job the moment it loaded it, before any file of this attempt was written
        assert r["valid"], r
        assert r["step"] % SAVE_STEPS == 0 and Path(r["path"]).name == f"checkpoint-{r['step']}", r
    # at least one kill left a broken newest step behind (a mid-save kill), which the next resume skipped
    print(f"{job}: kills {plan.done}; resumes {[(r['attempt'], r['step']) for r in resumes]}")
    torn = [(a, how, steps) for a, how, steps in plan.done if steps and not steps[-1][1]]
    assert torn, plan.done
    from safetensors.torch import load_file

    assert reference.wait(timeout=300) == 0
    ref, got = load_file(str(tmp / "ref.safetensors")), load_file(str(final))
    assert ref.keys() == got.keys()
    unequal = [k for k in ref if not torch.equal(ref[k], got[k])]
    assert not unequal, unequal


@pytest.mark.timeout(900)  # ~1 min on an idle 2-core machine; far more when it is shared
def test_hf_trainer_under_rlsup_killed_at_random_moments(tmp_path: Path) -> None:
    _check("hf_train_job.py", tmp_path, seed=18)

