"""Issue 28's done-when for a public single-file-checkpoint trainer installed from PyPI (so CI runs it, unlike
nanoGPT, whose code is not committed): PyKEEN's ``pykeen experiments run``, unmodified, on CPU
(tests/thirdparty/setup_pykeen.py says why PyKEEN and what it saves), under ``rlsup run`` with the README's
single-file flags. Its training process is SIGKILLed six times, once in each attempt after that attempt's
first new save (issue 41: PyKEEN prints its progress only at the save, so each of these attempts reports one
step; more than ``max_no_progress_attempts``, 5, of them in a row once ended in a false exit 76): right after
the save, in the next epoch, or inside the next ``torch.save`` that rewrites ``ckpts/ckpt.pt`` in place
(ckpt.pt's stat polled every ~0.5 ms from the epoch's last batches on, the kill as soon as the new save's first
bytes are there; repeated until one left the file torn). Each restart resumes from the newest complete epoch
(rlsup puts the newest complete version back when the file is torn; PyKEEN's own "loaded checkpoint ... finished
epoch N" line says where it resumed), a torn save costs at most one epoch, the run reaches its last epoch and
exits 0, no incident is ``no_progress``, and since PyKEEN restores its RNG states the final weights equal an
uninterrupted run's.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.env import clean_env, job_env
from support.files import file_stat
from support.incidents import incidents
from support.procs import rlsup_cmd, sigkill
from support.trainers import FAST, Supervised
from support.waits import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
import setup_pykeen as sp

torch = pytest.importorskip("torch")
psutil = pytest.importorskip("psutil")
pytest.importorskip("pykeen")

KILLS = 6  # one more than max_no_progress_attempts' default: each attempt killed after its first new save
# each kill moves the newest complete epoch on by one (a torn save's by one net): six kills end near epoch 6-7,
# and the last attempt trains the rest (sp.EPOCHS, 12, would add three epochs here and in the reference run)
EPOCHS = 9
NEAR_SAVE = 9  # of an epoch's 13 batches: the "save" kill polls ckpt.pt tightly only from this batch on
BATCH_RE = re.compile(r"Training batches on cpu:\s*\d+%\|[^|]*\|\s*(\d+)(?:\.\d+)?/")


def _pykeen_proc(p: "psutil.Process") -> bool:
    cmd = p.cmdline()
    return any(Path(a).name == "pykeen" for a in cmd[:2]) and "experiments" in cmd


def _saved(log: str) -> list[int]:
    return [int(m) for m in re.findall(sp.SAVED_RE, log)]


def _resumed_epoch(log: str) -> int | None:
    """The epoch an attempt started from: 0 on a fresh start, else PyKEEN's "loaded checkpoint" line's."""
    if sp.FRESH_LINE in log:
        return 0
    m = re.search(sp.RESUMED_RE, log)
    return int(m.group(1)) if m else None


def _batch_after_last_save(log: str) -> int:
    """The highest batch of the epoch after the newest "Saved checkpoint" line (0 when none drawn yet)."""
    tail = log[log.rfind("Saved checkpoint"):] if "Saved checkpoint" in log else log
    return max((int(m) for m in BATCH_RE.findall(tail)), default=0)


def _pykeen_kill(job: Supervised, n: int, how: str, rng: random.Random) -> bool:
    """SIGKILL attempt ``n``'s trainer once it has saved an epoch of its own: ``first`` = as soon as that save's
    line is out; ``save`` = the instant ckpt.pt has changed and holds bytes again (the next epoch's save is
    writing it); ``random`` = a seeded batch of the next epoch."""
    ckpt = job.cwd / sp.CKPT_DIR / sp.CKPT_NAME
    proc = job.wait_trainer(n, _pykeen_proc, "pykeen experiments run")
    if proc is None:
        return False
    wait_for(lambda: job.ended() or _resumed_epoch(job.attempt_log(n)) is not None, 240,
             f"attempt {n} to say where it starts")
    start = _resumed_epoch(job.attempt_log(n))
    if start is None:
        return False
    wait_for(lambda: job.ended() or any(e > start for e in _saved(job.attempt_log(n))), 240,
             f"attempt {n}'s first save", interval=0.02)
    if job.ended():
        return False
    if how == "save":
        before = file_stat(ckpt)  # torch.save truncates the file, then writes it record by record: kill after its
        # first bytes, so the cut lies inside the zip (a cut before the first byte leaves it empty)

        def saving() -> bool:
            return job.ended() or not proc.is_running() or ((now := file_stat(ckpt)) != before and now[1] > 0)

        # polled every 0.5 ms, from the end of the epoch on (the bar says; every 50 ms before: an epoch is seconds)
        wait_for(lambda: saving() or _batch_after_last_save(job.attempt_log(n)) >= NEAR_SAVE, 240,
                 f"attempt {n} near its next save")
        wait_for(saving, 240, f"attempt {n}'s next save", interval=0.0005)
    elif how == "random":
        batch = rng.randint(2, 9)
        wait_for(lambda: job.ended() or _batch_after_last_save(job.attempt_log(n)) >= batch, 240,
                 f"attempt {n}'s batch {batch}", interval=0.02)
    if job.ended() or not sigkill(proc.pid):
        return False
    try:
        data = ckpt.read_bytes()  # right after the kill, before rlsup's restart puts a version back
    except FileNotFoundError:
        data = b""
    log = job.attempt_log(n)
    job.kills.append({"attempt": n, "how": how, "start": start, "last_saved": max(_saved(log), default=None),
                      "ckpt_bytes": len(data), "ckpt_epoch": sp.ckpt_epoch(data)})
    return True


def _weights(path: Path) -> dict:
    state = sp.ckpt_state(path.read_bytes())
    assert state is not None, f"{path} does not load"
    return state


@pytest.mark.timeout(600)
def test_pykeen_single_file_survives_kills_mid_save(tmp_path: Path) -> None:
    t0 = time.monotonic()
    work = sp.workdir(tmp_path / "run", EPOCHS)
    ref_dir = sp.workdir(tmp_path / "reference", EPOCHS)
    env = job_env(work, **sp.env(work))
    # an uninterrupted run beside it, for the final weights
    ref_out = open(ref_dir / "out.log", "w")
    reference = subprocess.Popen(sp.LAUNCH, cwd=ref_dir, env=job_env(ref_dir, **sp.env(ref_dir)), stdout=ref_out,
                                 stderr=subprocess.STDOUT)
    job = Supervised.start(work, [*sp.RLSUP, *FAST], sp.LAUNCH, env)
    rng = random.Random(28)
    try:
        plan = ["first", "save", "first", "random", "save", "first", "save", "first"]  # 6 kills, one tore ckpt.pt
        for n, how in enumerate(plan):
            tore = any(k["how"] == "save" and k["ckpt_epoch"] is None for k in job.kills)
            if len(job.kills) >= KILLS and tore:
                break
            if not _pykeen_kill(job, n, "first" if how == "save" and tore else how, rng):  # epochs are few
                break
        rc = job.finish()
        ref_rc = reference.wait(timeout=300)
    finally:
        for p in (job.proc, reference):
            if p.poll() is None:
                p.kill()
        ref_out.close()
    report = job.report()
    assert ref_rc == 0, (ref_dir / "out.log").read_text()[-3000:]
    assert rc == 0, report
    assert len(job.kills) >= KILLS and [k["attempt"] for k in job.kills] == list(range(len(job.kills))), report
    torn = [k for k in job.kills if k["how"] == "save" and k["ckpt_epoch"] is None]
    assert torn, f"no kill landed inside a torch.save of ckpt.pt\n{report}"
    last = job.attempt()
    assert max(_saved(job.attempt_log(last))) == EPOCHS, report
    for k in job.kills:  # the next attempt resumed from the newest complete epoch; a torn save cost <= 1 epoch
        resumed = _resumed_epoch(job.attempt_log(k["attempt"] + 1))
        expected = k["ckpt_epoch"] if k["ckpt_epoch"] is not None else (k["last_saved"] or 0)
        assert resumed == expected, (k, resumed, report)
        assert k["last_saved"] is not None and k["last_saved"] + 1 - resumed <= 1, (k, resumed, report)
    out = job.output()
    assert out.count("put back its newest complete") >= len(torn), report
    recs = incidents(job.state_dir)
    assert len(recs) == len(job.kills), report
    assert all(r["action"] == "restart" and r["reason"] == "signal" for r in recs), report
    for rec in recs:
        assert Path(rec.get("resumed_from") or "").name == sp.CKPT_NAME, (rec, report)
    listing = subprocess.run(rlsup_cmd("incidents", str(job.state_dir)), env=clean_env(), capture_output=True,
                             text=True, timeout=60).stdout
    assert "no_progress" not in listing and rc != 76, listing
    assert job.status_json()["job"].get("last_step") == EPOCHS, report
    # the final checkpoint loads, at the last epoch, with the uninterrupted run's weights
    final, ref = _weights(work / sp.CKPT_DIR / sp.CKPT_NAME), _weights(ref_dir / sp.CKPT_DIR / sp.CKPT_NAME)
    assert final["epoch"] == ref["epoch"] == EPOCHS, report
    assert final["model_state_dict"].keys() == ref["model_state_dict"].keys()
    for name, t in final["model_state_dict"].items():
        assert torch.equal(t, ref["model_state_dict"][name]), (name, report)
    resumed = [_resumed_epoch(job.attempt_log(k["attempt"] + 1)) for k in job.kills]
    print(f"pykeen kills: {job.kills}; resumed: {resumed}; {time.monotonic() - t0:.1f} s")
