"""Issue 28's done-when: real third-party training programs that nobody here wrote, run unmodified (only CPU
flags), under ``rlsup run`` with the README's flags ("Using rlsup with your trainer"), each SIGKILLed at least
three times, one kill in the middle of a save, reach their last step; every restart resumes from the newest
complete checkpoint; no run ends with exit 76.

Programs (set-up: tests/thirdparty/setup_trainers.py; sources, licences and commits there):

- nanoGPT (karpathy/nanoGPT ``train.py``, not committed: tests/thirdparty/nanogpt/SOURCE; skipped without it): one ``out/ckpt.pt`` rewritten in place by ``torch.save``
  every ``eval_interval`` iterations; launched with ``--checkpoint-layout single-file --checkpoint-file ckpt.pt``
  and ``--init_from={resume?resume:scratch}``. nanoGPT restores iter_num, model and optimizer but not the RNG,
  so its final weights cannot equal an uninterrupted run's: the checks are the resumed iteration of every
  attempt (the newest complete save, read from nanoGPT's own "step N" line) and that a kill mid-save costs at
  most one save interval (rlsup puts the newest complete version back when the file is torn).
- ``trl sft`` (the installed trl's console script and, under 2-rank torchrun, its module ``trl.scripts.sft``
  launched by the README's own line, as written, which is thereby also that line's test):
  HF ``checkpoint-N`` directories, resumed through ``{resume:--resume_from_checkpoint={dir}}`` (no shell
  wrapper, so torchrun stays visible and the warm launcher keeps warm ranks). HF restores the RNG and skips the
  trained batches, so the final weights (``out/model.safetensors``) must equal an uninterrupted run's.
- ``run_clm.py`` (transformers' example): when tests/thirdparty/hf_run_clm/run_clm.py is there (see its
  README.md: not committed), the same checks; skipped otherwise.

Kills are SIGKILLs of the training process (a rank under torchrun), never of rlsup: "mid-save" = the moment a
new ``checkpoint-N`` directory appears (polled every 1 ms from 2-3 steps before the save, as the trainer's bar
says, every 50 ms before), or the moment ``ckpt.pt`` changes (polled every ~0.5 ms); "random" =
a seeded delay after the newest save completed (inside a training step).
"""

from __future__ import annotations

import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
from support.env import ROOT, clean_env, job_env
from support.files import file_stat
from support.incidents import incidents
from support.procs import rlsup_cmd, sigkill
from support.trainers import FAST, Supervised
from support.waits import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
import setup_trainers as st

torch = pytest.importorskip("torch")
psutil = pytest.importorskip("psutil")
NANOGPT_RLSUP = ["--checkpoint-dir", "out", "--checkpoint-layout", "single-file", "--checkpoint-file", "ckpt.pt",
                 "--progress", "nanogpt"]
HF_RLSUP = ["--checkpoint-dir", "out", "--progress", "hf"]
RESUME_ARG = "{resume:--resume_from_checkpoint={dir}}"
# 25 steps: the three kills land at the saves of steps 5, 10 and 15 (a save kill repeated at most twice more)
SFT_MAX_STEPS, SFT_SAVE_STEPS = 25, 5
SFT_ARGS = ["--model_name_or_path", "tiny-llama", "--dataset_name", "data", "--output_dir", "out",
            "--max_steps", str(SFT_MAX_STEPS), "--save_steps", str(SFT_SAVE_STEPS), "--per_device_train_batch_size", "2",
            "--max_length", "32", "--learning_rate", "1e-3", "--use_cpu", "--report_to", "none", "--seed", "1",
            "--data_seed", "1", "--disable_tqdm", "false"]


# -------------------------------------------------------------------------------------------------- nanoGPT
def _nanogpt_proc(p: "psutil.Process") -> bool:
    return "train.py" in p.cmdline()


def _iters(log: str) -> list[int]:
    return [int(m) for m in re.findall(r"^iter (\d+): loss", log, re.M)]


def _evals(log: str) -> list[int]:
    return [int(m) for m in re.findall(r"^step (\d+): train loss", log, re.M)]


def _resumed_iter(log: str) -> int | None:
    """The iteration an attempt started from: 0 on a fresh start, else its first eval ("step N:")."""
    if "Initializing a new model from scratch" in log:
        return 0
    if "Resuming training from" in log:
        ev = _evals(log)
        return ev[0] if ev else None
    return None


def _ckpt_iter(data: bytes) -> int | None:
    """nanoGPT's iter_num in a ckpt.pt's bytes, or None when they do not load (torn)."""
    import io

    try:
        return int(torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")["iter_num"])
    except Exception:  # a torn zip raises any of several errors
        return None


def _nanogpt_kill(job: Supervised, n: int, how: str, rng: random.Random) -> bool:
    """SIGKILL attempt ``n``'s train.py: ``save`` = the instant ckpt.pt changes, once a complete save exists
    and the attempt is past its re-save of the resumed iteration; ``random`` = a seeded iteration."""
    ckpt = job.cwd / "out" / "ckpt.pt"
    proc = job.wait_trainer(n, _nanogpt_proc, "nanoGPT's train.py")
    if proc is None:
        return False
    wait_for(lambda: job.ended() or _resumed_iter(job.attempt_log(n)) is not None, 240,
             f"attempt {n} to print its start iteration")
    start = _resumed_iter(job.attempt_log(n))
    if start is None:
        return False
    # a save kill waits until a complete save of this run exists (it then tears the next one); a random kill
    # comes 25-35 iterations in: after the attempt's first new save (start + interval), so the run moves on
    interval = st.NANOGPT_EVAL_INTERVAL
    wait_iter = max(start + 3, interval + 3) if how == "save" else start + rng.randint(interval + 5, interval + 15)
    wait_for(lambda: job.ended() or any(i >= wait_iter for i in _iters(job.attempt_log(n))), 240,
             f"attempt {n} to reach iteration {wait_iter}", interval=0.005)
    if job.ended():
        return False
    if how == "save":
        before = file_stat(ckpt)
        wait_for(lambda: job.ended() or not proc.is_running() or file_stat(ckpt) != before, 240,
                 f"attempt {n}'s next save", interval=0.0005)
    if not sigkill(proc.pid):
        return False
    try:
        data = ckpt.read_bytes()  # right after the kill, before rlsup's restart puts a version back
    except FileNotFoundError:
        data = b""
    log = job.attempt_log(n)
    job.kills.append({"attempt": n, "how": how, "start": start, "last_iter": max(_iters(log), default=None),
                      "last_eval": max(_evals(log), default=None), "ckpt_bytes": len(data),
                      "ckpt_iter": _ckpt_iter(data)})
    return True


@pytest.mark.timeout(600)
def test_nanogpt_single_file_survives_kills_mid_save(tmp_path: Path) -> None:
    work = st.nanogpt_workdir(tmp_path / "nanogpt")
    launch = ["python", "train.py", *st.NANOGPT_FLAGS, "--init_from={resume?resume:scratch}"]
    job = Supervised.start(work, [*NANOGPT_RLSUP, *FAST], launch, job_env(work))
    rng = random.Random(28)
    interval = st.NANOGPT_EVAL_INTERVAL
    try:
        plan = ["random", "save", "random", "save", "save"]  # until 3 kills, one of which tore ckpt.pt
        for n, how in enumerate(plan):
            if len(job.kills) >= 3 and any(k["how"] == "save" and k["ckpt_iter"] is None for k in job.kills):
                break
            if not _nanogpt_kill(job, n, how, rng):
                break
        rc = job.finish()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    report = job.report()
    assert rc == 0, report
    assert len(job.kills) >= 3, report
    torn = [k for k in job.kills if k["how"] == "save" and k["ckpt_iter"] is None]
    assert torn, f"no kill landed inside a torch.save of ckpt.pt\n{report}"
    last = job.attempt()
    final_log = job.attempt_log(last)
    assert max(_iters(final_log)) == st.NANOGPT_MAX_ITERS, report
    assert _ckpt_iter((work / "out" / "ckpt.pt").read_bytes()) == st.NANOGPT_MAX_ITERS, report
    for k in job.kills:  # the next attempt resumed from the newest complete save; a torn one cost <= 1 interval
        resumed = _resumed_iter(job.attempt_log(k["attempt"] + 1))
        if k["ckpt_iter"] is not None:
            expected = k["ckpt_iter"]  # the file was complete when the trainer died
        elif k["last_eval"] is None or k["last_eval"] == 0:
            expected = 0  # torn first save (nothing before it) or killed before any save
        elif k["last_eval"] == k["start"]:
            expected = k["start"]  # torn re-save of the resumed iteration: the version it resumed from
        else:
            expected = k["last_eval"] - interval  # torn save of last_eval: the save before it
        assert resumed == expected, (k, resumed, report)
        if k["last_iter"] is not None:
            assert k["last_iter"] - resumed <= interval + 1, (k, resumed, report)
    recs = incidents(job.state_dir)
    assert len(recs) == len(job.kills), report
    assert all(r["action"] == "restart" and r["reason"] == "signal" for r in recs), report
    for k, rec in zip(job.kills, recs):  # the trainer's iteration from its "iter N:" lines; a file names no step
        assert k["last_iter"] is None or (rec.get("last_step") or -1) >= k["last_iter"], (k, rec, report)
        assert rec.get("resume_known") is False and rec.get("resumed_step") is None, (rec, report)
        assert Path(rec.get("resumed_from") or "").name == "ckpt.pt", (rec, report)
    assert job.status_json()["job"].get("last_step") == st.NANOGPT_MAX_ITERS, report
    assert "steps lost unknown" in subprocess.run(rlsup_cmd("incidents", str(job.state_dir)), env=clean_env(),
                                                  capture_output=True, text=True, timeout=60).stdout, report
    assert "no_progress" not in {r["action"] for r in recs} and rc != 76, report
    print(f"nanoGPT kills: {job.kills}; resumed: {[_resumed_iter(job.attempt_log(k['attempt'] + 1)) for k in job.kills]}")


# ------------------------------------------------------------------------------------------------- trl sft
def _hf_inputs(work: Path) -> Path:
    pytest.importorskip("transformers")
    pytest.importorskip("trl")
    work.mkdir(parents=True, exist_ok=True)
    st.hf_model_dir(work / "tiny-llama")
    st.text_dataset(work / "data")
    return work


def _hf_steps(out: Path) -> list[tuple[int, bool]]:
    from supervisor import layouts

    return [(r.step, r.valid) for r in layouts.scan(out)] if out.exists() else []


def _checkpoint_dirs(out: Path) -> dict[str, int]:
    """Each checkpoint-N directory and the newest change in it (ns): a save into a directory a killed save left
    torn changes it without making a new directory."""
    found = {}
    try:
        dirs = [p for p in os.scandir(out) if p.name.startswith("checkpoint-")]
    except FileNotFoundError:
        return {}
    for d in dirs:
        try:
            found[d.name] = max([d.stat().st_mtime_ns, *(e.stat().st_mtime_ns for e in os.scandir(d.path))])
        except FileNotFoundError:  # removed (rotated) between the listing and the look
            continue
    return found


def _saved_since(out: Path, before: dict[str, int]) -> set[str]:
    """The checkpoint directories new or written since ``before``."""
    return {name for name, mark in _checkpoint_dirs(out).items() if before.get(name) != mark}


def _rank_proc(workdir: Path, script: str) -> Callable[["psutil.Process"], bool]:
    """A training process: a cold or forked one runs ``script`` (a forked warm rank writes the worker's command
    line over its zygote's); a spawned warm rank (its cmdline is warm_rank.py's) is told apart from the next
    attempt's idle warm ranks by the datasets cache it has mapped. Launchers are told by their command's head: a
    trainer's arguments name the test's directory (``--resume_from_checkpoint=.../test_trl_sft_torchrun_...``)."""
    cache = str(workdir / "hf-datasets-cache")

    def match(p: "psutil.Process") -> bool:
        argv = p.cmdline()
        cmd, head = " ".join(argv), " ".join(argv[:4]) + " "  # the launchers' names, never in their arguments
        if "warm_rank.py" in cmd:
            try:
                with open(f"/proc/{p.pid}/maps") as f:
                    return cache in f.read()
            except OSError:
                return False
        # not rlsup's own children forked per call (their cmdline is rlsup's, which names the script): short-lived
        return script in cmd and not any(w in head for w in ("torch.distributed.run", "torchrun", "warm_launcher",
                                                              "/bin/trl ", "supervisor.cli.main", "bin/rlsup "))

    return match


def _hf_kill(job: Supervised, n: int, how: str, rng: random.Random, match: Callable) -> bool:
    """SIGKILL one training process of attempt ``n``: ``save`` = the instant a checkpoint-N directory appears or
    is written again (a save into one a killed save left torn); ``random`` = a seeded delay (0-0.3 s, cut short by
    the next save) after the attempt's first complete new save. The directories are polled every 2 ms from the
    moment the attempt's trainer is seen (a warm attempt of this tiny model trains up to ~200 steps/s: a save
    interval is a few tens of ms)."""
    out = job.cwd / "out"
    proc = job.wait_trainer(n, match, "a training process")
    if proc is None:
        return False
    before = _checkpoint_dirs(out)

    def new_dirs() -> set[str] | bool:
        return job.ended() or _saved_since(out, before)

    new = wait_for(new_dirs, 240, f"a new checkpoint of attempt {n}", interval=0.002)
    if new is True or job.ended():
        return False
    if how == "random":
        name = sorted(new)[0]
        wait_for(lambda: job.ended() or (out / name / "trainer_state.json").exists(), 240, f"{name} to complete",
                 interval=0.005)
        if job.ended():
            return False
        # no later than the next save's start: a warm attempt trains ~40 steps/s here (nothing imports beside it:
        # the next attempt's warm ranks are forked), so a later moment can pass the job's last save and leave the
        # next kill no save to land in
        delay = rng.uniform(0.0, 0.3)
        deadline, seen = time.monotonic() + delay, _checkpoint_dirs(out)
        wait_for(lambda: time.monotonic() >= deadline or bool(_saved_since(out, seen)), delay + 5,
                 "the random kill moment", interval=0.002)
    if not sigkill(proc.pid):
        return False
    # the steps as rlsup chose among them: once the attempt's incident is written every process of it is gone
    # (a surviving rank cannot complete a step any more) and the next attempt is seconds from its first save
    wait_for(lambda: job.ended() or len(incidents(job.state_dir)) > len(job.kills), 120, f"attempt {n}'s incident")
    job.kills.append({"attempt": n, "how": how, "pid": proc.pid, "new": sorted(new), "steps_after": _hf_steps(out)})
    return True


def _hf_kills(job: Supervised, match: Callable, seed: int) -> None:
    """Three kills (mid-save, random, mid-save); more mid-save ones (at most two) until one left a torn step."""
    rng = random.Random(seed)
    for n, how in enumerate(["save", "random", "save", "save", "save"]):
        if len(job.kills) >= 3 and any(k["steps_after"] and not k["steps_after"][-1][1] for k in job.kills):
            return
        if not _hf_kill(job, n, how, rng, match):
            return


def _newest_valid(steps: list[tuple[int, bool]]) -> int | None:
    valid = [s for s, ok in steps if ok]
    return max(valid) if valid else None


def _check_hf_run(job: Supervised, rc: int, reference: Path,
                  steps: tuple[int, int] = (SFT_MAX_STEPS, SFT_SAVE_STEPS)) -> None:
    from safetensors.torch import load_file

    max_steps, save_steps = steps
    report = job.report()
    assert rc == 0, report
    assert len(job.kills) >= 3, report
    torn = [k for k in job.kills if k["steps_after"] and not k["steps_after"][-1][1]]
    assert torn, f"no kill left a torn newest checkpoint-N\n{report}"
    recs = [r for r in incidents(job.state_dir) if not _exit_abort_after_training(job, r)]
    assert len(recs) == len(job.kills), report
    for k, rec in zip(job.kills, recs):  # each restart: the newest checkpoint that was complete at the kill
        assert rec["action"] == "restart", report
        expected = _newest_valid(k["steps_after"])
        assert rec.get("resumed_step") == expected, (k, rec, report)
        # the trainer's own step from its bar, not a save's "Writing model shards 1/1" nor a resumed attempt's
        # first draw "0/25", or unknown (None). tqdm redraws at most every 0.1 s, so the last bar printed may
        # lag the step a complete checkpoint proves by a few steps: less than a save interval is tolerated
        assert rec.get("last_step") is None or rec["last_step"] > (expected or 0) - save_steps, (k, rec, report)
        if expected is not None:
            assert Path(rec["resumed_from"]).name == f"checkpoint-{expected}", (k, rec, report)
    assert rc != 76 and "no_progress" not in {r["action"] for r in recs}, report
    ref, got = load_file(str(reference)), load_file(str(job.cwd / "out" / "model.safetensors"))
    assert ref.keys() == got.keys()
    assert not [k for k in ref if not torch.equal(ref[k], got[k])], f"final weights differ\n{report}"
    state = job.status_json()["job"]
    if not any(_exit_abort_after_training(job, r) for r in incidents(job.state_dir)):  # else no step after it
        assert state.get("last_step") == max_steps, (state, report)  # the trainer's step, not a save bar's


def _reference(work: Path, launch: list[str]) -> subprocess.Popen:
    """The same launch line without rlsup and without the resume argument: the uninterrupted run."""
    ref = work / "reference"
    ref.mkdir()
    for name in ("tiny-llama", "data"):
        (ref / name).symlink_to(work / name)
    cmd = [a for a in launch if a != RESUME_ARG]
    return subprocess.Popen(cmd, cwd=ref, env=job_env(ref), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _hf_under_rlsup(tmp_path: Path, launch: list[str], script: str, seed: int, rlsup_args: list[str] = HF_RLSUP,
                    steps: tuple[int, int] = (SFT_MAX_STEPS, SFT_SAVE_STEPS)) -> Supervised:
    """``launch`` under ``rlsup run rlsup_args``, killed by :func:`_hf_kills`, beside its uninterrupted run;
    ``steps`` = (max_steps, save_steps) of the launch line."""
    work = _hf_inputs(tmp_path / "hf")
    reference = _reference(work, launch)
    job = Supervised.start(work, [*rlsup_args, *FAST], launch, job_env(work))
    try:
        _hf_kills(job, _rank_proc(work, script), seed)
        rc = job.finish()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert reference.wait(timeout=300) == 0
    _check_hf_run(job, rc, work / "reference" / "out" / "model.safetensors", steps)
    return job


@pytest.mark.timeout(600)
def test_trl_sft_cli_single_process_survives_kills(tmp_path: Path) -> None:
    """``trl sft`` as its users type it (the console script; accelerate's launcher starts the trainer)."""
    job = _hf_under_rlsup(tmp_path, ["trl", "sft", *SFT_ARGS, RESUME_ARG], "trl/scripts/sft.py", seed=281)
    print(f"trl sft kills: {job.kills}")


@pytest.mark.timeout(600)
def test_trl_sft_torchrun_two_ranks_survives_kills_with_warm_ranks(tmp_path: Path) -> None:
    """The README's HF/TRL line as written (also ``test_readme_trainer_line_runs_as_written[trl.scripts.sft]``,
    whose run this is): trl's SFT script under 2-rank torchrun, resume point from the placeholder (no wrapper,
    warm ranks kept), SIGKILLed three times (mid-save, random, mid-save), resumes from the newest complete
    checkpoint each time, finishes with an uninterrupted run's weights, and its restarts start from warm ranks."""
    argv = shlex.split(next(ln for ln in readme_trainer_lines() if _line_key(ln) == "trl.scripts.sft"))
    assert argv[:2] == ["rlsup", "run"] and "--" in argv, argv
    sep = argv.index("--")
    launch = argv[sep + 1:]
    assert launch[:5] == ["torchrun", "--standalone", "--nproc-per-node", "2", "-m"] and RESUME_ARG in launch, launch
    steps = (int(launch[launch.index("--max_steps") + 1]), int(launch[launch.index("--save_steps") + 1]))
    job = _hf_under_rlsup(tmp_path, launch, "trl.scripts.sft", seed=282, rlsup_args=argv[2:sep], steps=steps)
    report = job.report()
    assert "started by the warm launcher" in job.output(), report
    warm_logs = [job.attempt_log(n) for n in range(1, job.attempt() + 1)]
    assert any("local rank(s) started from warm ranks" in log for log in warm_logs), report
    # the README line's own acceptance: a restart resumed from a checkpoint that existed (the random kill's,
    # after a complete save), and the attempt after the last kill reached the trainer's last line
    recs = incidents(job.state_dir)
    assert any(r.get("resumed_from") and r.get("resumed_step") for r in recs), report
    assert README_LINES["trl.scripts.sft"][3] in job.attempt_log(job.kills[-1]["attempt"] + 1), report
    for rec in recs[len(job.kills):]:  # only TRL's abort at exit, after its last step (_exit_abort_after_training)
        assert _exit_abort_after_training(job, rec) and rec.get("resumed_step") == steps[0], report
    print(f"trl sft torchrun kills: {job.kills}")


@pytest.mark.timeout(600)
def test_run_clm_torchrun_survives_kills(tmp_path: Path) -> None:
    run_clm = st.run_clm_path()
    if run_clm is None:
        pytest.skip("run_clm.py is not here: tests/thirdparty/hf_run_clm/README.md says how to put it there")
    work = _hf_inputs(tmp_path / "hf")
    st.hf_config_dir(work / "tiny-config")
    launch = ["torchrun", "--standalone", "--nproc-per-node", "2", str(run_clm), "--config_name", "tiny-config",
              "--tokenizer_name", "tiny-config", "--train_file", "data/train.txt", "--do_train", "--output_dir", "out",
              "--max_steps", str(SFT_MAX_STEPS), "--save_steps", str(SFT_SAVE_STEPS), "--per_device_train_batch_size",
              "2", "--block_size", "32", "--use_cpu", "--report_to", "none", "--seed", "1", "--data_seed", "1",
              RESUME_ARG]
    (work / "reference").mkdir()
    (work / "reference" / "tiny-config").symlink_to(work / "tiny-config")
    (work / "reference" / "data").symlink_to(work / "data")
    reference = subprocess.Popen([a for a in launch if a != RESUME_ARG], cwd=work / "reference",
                                 env=job_env(work / "reference"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    job = Supervised.start(work, [*HF_RLSUP, *FAST], launch, job_env(work))
    try:
        _hf_kills(job, _rank_proc(work, run_clm.name), 283)
        rc = job.finish()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    assert reference.wait(timeout=300) == 0
    _check_hf_run(job, rc, work / "reference" / "out" / "model.safetensors")


# ------------------------------------------------------------------------------------------- a stopped rank
# the stop comes once checkpoint-40 is complete (the timeout learned by then); the resumed attempt runs 20 more
HANG_MAX_STEPS, HANG_SAVE_STEPS = 60, 20
# --warm-launcher false: both attempts start cold (TRL's warm ranks are the kill test's subject), and no launcher is
# armed for a restart that never comes (no exact budget: a rank's abort at exit may add one, _exit_abort_after_training)
HANG_RLSUP = ["--auto-timeout-floor", "3", "--auto-timeout-min-intervals", "5", "--heartbeat-timeout-initial", "60",
              "--warm-launcher", "false"]


def _exit_abort_after_training(job: Supervised, rec: dict) -> bool:
    """Seen in CI, several times: TRL's script never destroys its process group, and after training and the model's
    save a rank aborts in interpreter exit (gloo's threads meet finalization, pytorch/pytorch#179291: "terminate
    called without an active exception"); rlsup restarts from the final checkpoint, as it should. Not the tests'."""
    return rec.get("signal") == "SIGABRT" and "Model saved" in job.attempt_log(rec["attempt"])


@pytest.mark.timeout(600)
def test_trl_sft_torchrun_sigstopped_rank_is_a_hang_with_stacks(tmp_path: Path) -> None:
    """A SIGSTOPped rank of the 2-rank run (progress from HF's own bar, ``--progress hf``) is caught as a hang
    within the learned timeout plus one step, with the stopped rank's stacks in the incident; the run then
    resumes and finishes, and ``rlsup status``/``rlsup incidents`` show the trainer's real steps."""
    work = _hf_inputs(tmp_path / "hf")
    args = [a for a in SFT_ARGS]
    args[args.index("--max_steps") + 1], args[args.index("--save_steps") + 1] = str(HANG_MAX_STEPS), str(HANG_SAVE_STEPS)
    launch = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "trl.scripts.sft", *args, RESUME_ARG]
    job = Supervised.start(work, [*HF_RLSUP, *FAST, *HANG_RLSUP], launch, job_env(work))
    match = _rank_proc(work, "trl.scripts.sft")
    out = work / "out"
    try:
        job.wait_trainer(0, match, "the ranks")
        ranks = wait_for(lambda: job.ended() or (len(job.trainers(match)) == 2 and job.trainers(match)), 240, "2 ranks")
        assert ranks is not True, job.report()
        stop_at = f"checkpoint-{2 * HANG_SAVE_STEPS}"
        # complete: rank 0's trainer_state.json and both ranks' rng files (rank 1 may write its own after rank 0's
        # commit: stopped before that, the step is rightly not valid and the run resumes from the one before)
        wait_for(lambda: job.ended() or all((out / stop_at / f).exists() for f in (
            "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth")), 240, f"{stop_at} complete")
        assert not job.ended(), job.report()
        victim = max(ranks, key=lambda p: p.pid)  # either rank; one of the two, stopped, holds the other
        os.kill(victim.pid, signal.SIGSTOP)
        stopped = time.time()
        hang = wait_for(lambda: job.ended() or next((i for i in incidents(job.state_dir) if i["reason"] == "hang"),
                                                    None), 240, "the hang incident", interval=0.05)
        rc = job.finish()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    report = job.report()
    assert hang is not True and rc == 0, report
    # "rank R (pid P) silent for S s > heartbeat_timeout T s": T is the learned timeout in force, S the silence
    # since the last progress line when rlsup called it a hang (the stop came at most one step after that line)
    m = re.search(r"silent for ([0-9.]+)s > heartbeat_timeout ([0-9.]+)s", hang["detail"])
    assert m, hang["detail"]
    silent, learned = float(m.group(1)), float(m.group(2))
    assert learned >= 3, (learned, report)  # learned from the steps, at least the floor
    # one step here is ~0.05-0.2 s; 1 s bounds it and the 0.1 s poll on a loaded machine
    assert silent <= learned + 1.0, (silent, learned, report)
    # the call came after the stop (how long the stack dumps then took is the machine's load, not a claim)
    assert hang["time"] >= stopped, (hang["time"], stopped, report)
    stacks = hang["stacks"]
    assert stacks and any(str(victim.pid) in k or str(victim.pid) in v for k, v in stacks.items()), (stacks, report)
    victim_stack = next(v for k, v in stacks.items() if str(victim.pid) in k or str(victim.pid) in v)
    assert "could not read" not in victim_stack and "process stopped" in victim_stack, victim_stack
    assert "Trainer" in victim_stack or "sft" in victim_stack, victim_stack  # its Python frames, read while stopped
    assert 2 * HANG_SAVE_STEPS <= (hang.get("last_step") or -1) < HANG_MAX_STEPS, (hang, report)
    assert hang.get("resumed_step") == 2 * HANG_SAVE_STEPS or (hang.get("resumed_step") or 0) > 2 * HANG_SAVE_STEPS, hang
    offline = job.incidents_json()
    aborts = [i for i in offline["incidents"] if _exit_abort_after_training(job, i)]
    assert all(i.get("resumed_step") == HANG_MAX_STEPS for i in aborts), (aborts, report)
    if not aborts:  # after such a restart the resumed attempt trains no step: its status shows none
        assert job.status_json()["job"].get("last_step") == HANG_MAX_STEPS, report
    assert [i.get("last_step") for i in offline["incidents"] if i not in aborts] == [hang.get("last_step")], offline
    print(f"hang caught after {silent:.2f}s of silence (learned timeout {learned:.2f}s), incident written "
          f"{hang['time'] - stopped:.2f}s after SIGSTOP; "
          f"last step {hang.get('last_step')}, resumed {hang.get('resumed_step')}")


# ------------------------------------------------------------------------------ the README's launch lines
def readme_trainer_lines() -> list[str]:
    """The ``rlsup run`` lines of the README's "Using rlsup with your trainer" block, continuations joined."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Using rlsup with your trainer\n(.*?)^## ", text, re.S | re.M)
    assert section, "README.md has no 'Using rlsup with your trainer' section"
    block = re.search(r"```bash\n(.*?)```", section.group(1), re.S)
    assert block, "its section has no bash block"
    joined = re.sub(r"\\\n\s*", "", block.group(1))
    return [ln.strip() for ln in joined.splitlines() if ln.strip().startswith("rlsup run ")]


# per line: (keyword in the line, inputs to build in the run's directory, the trainer process, when to kill it
# (a complete checkpoint exists), the trainer's last line)
def _examples(names: tuple[str, ...]) -> Callable[[Path], None]:
    def build(d: Path) -> None:
        (d / "examples").mkdir(parents=True, exist_ok=True)
        for name in names:
            (d / "examples" / name).write_bytes((ROOT / "examples" / name).read_bytes())
    return build


def _lightning_inputs(d: Path) -> None:
    pytest.importorskip("lightning")
    _examples(("lightning_train.py",))(d)


def _lightning_ckpts(d: Path) -> bool:
    return len([p for p in (d / "ckpts").glob("*.ckpt") if not p.name.startswith("last")]) >= 2 \
        if (d / "ckpts").is_dir() else False


README_LINES = {
    "trl.scripts.sft": (lambda d: _hf_inputs(d), "trl.scripts.sft",
                        lambda d: (d / "out" / "checkpoint-5" / "trainer_state.json").exists(), "Training completed"),
    "lightning_train.py": (_lightning_inputs, "lightning_train.py", _lightning_ckpts,
                           "finished at step 64"),
    "train.py": (lambda d: st.nanogpt_workdir(d), "train.py",
                 lambda d: any(i >= 25 for i in _iters(_latest_log(d))), "iter 100: loss"),
    "train_tiny.py": (_examples(("train_tiny.py",)), "train_tiny.py",
                      lambda d: bool(list((d / "checkpoints").glob("step_*/manifest.rank_00000.json"))),
                      "[train_tiny] step 40 loss"),
}


def _latest_log(d: Path) -> str:
    logs = sorted((d / ".rlsup" / "attempts").glob("attempt_*/output.log"))
    return logs[-1].read_text(errors="replace") if logs else ""


def _line_key(line: str) -> str:
    for key in README_LINES:  # the most specific first: "train.py" is also in "lightning_train.py"
        if key != "train.py" and key in line:
            return key
    return "train.py"


def test_readme_has_a_line_per_kind_of_trainer() -> None:
    keys = sorted(_line_key(line) for line in readme_trainer_lines())
    assert keys == sorted(README_LINES), keys


@pytest.mark.timeout(600)
@pytest.mark.parametrize("key", sorted(k for k in README_LINES if k != "trl.scripts.sft"))
def test_readme_trainer_line_runs_as_written(tmp_path: Path, key: str) -> None:
    """The README's line, as written (``rlsup`` = this checkout's CLI), in a directory holding the inputs it
    names; its training process is SIGKILLed once a complete checkpoint exists; it resumes and finishes. The
    TRL line's run is test_trl_sft_torchrun_two_ranks_survives_kills_with_warm_ranks (three kills, the same
    acceptance and more): a second 2-rank run of it here would prove nothing that one does not."""
    line = next(ln for ln in readme_trainer_lines() if _line_key(ln) == key)
    build, script, ready, last_line = README_LINES[key]
    work = tmp_path / "run"
    work.mkdir()
    build(work)
    argv = shlex.split(line)
    assert argv[:2] == ["rlsup", "run"] and "--" in argv, line
    sep = argv.index("--")
    job = Supervised.start(work, [*argv[2:sep], *FAST], argv[sep + 1:], job_env(work))
    match = _rank_proc(work, script)
    try:
        proc = job.wait_trainer(0, match, f"{script}")
        assert proc is not None, job.report()
        wait_for(lambda: job.ended() or ready(work), 240, f"a complete checkpoint of {script}")
        assert not job.ended(), job.report()
        assert sigkill(proc.pid), job.report()
        job.kills.append({"attempt": 0, "pid": proc.pid})
        rc = job.finish()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    report = job.report()
    assert rc == 0, report
    recs = incidents(job.state_dir)
    assert recs and recs[0]["action"] == "restart", report
    # it resumed from the checkpoint that existed, not from scratch (a single file names no step: path only)
    assert recs[0].get("resumed_from") and (recs[0].get("resumed_step") or key == "train.py"), report
    assert last_line in job.attempt_log(1), report
    assert len(recs) == 1, report  # (TRL's abort at exit, the one other incident seen: in the TRL line's test)
