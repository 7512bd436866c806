"""rlsup supervising NVIDIA nvidia-resiliency-ext's ``ft_launcher`` (real processes, 2 gloo ranks on CPU).

ft_launcher runs with ``--max-restarts 0``: it launches the ranks and hosts NVRx's rank monitors, and
rlsup owns restarts (resume from the newest verified checkpoint, incident records). See docs/nvrx.md.
Skipped when nvidia-resiliency-ext is not installed (it is the optional ``nvrx`` extra).
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

from support.env import ROOT
from support.incidents import incidents
from support.procs import run_rlsup

try:
    import nvidia_resiliency_ext.fault_tolerance  # noqa: F401
except ImportError as e:  # absent (ModuleNotFoundError) or a broken install: say which
    pytest.skip(f"nvidia-resiliency-ext is not importable ({type(e).__name__}: {e}); it is the optional "
                "'nvrx' extra, see docs/nvrx.md", allow_module_level=True)


def _ft_launcher() -> str | None:
    beside = Path(sys.executable).parent / "ft_launcher"  # the venv's console script
    return str(beside) if beside.exists() else shutil.which("ft_launcher")


FT_LAUNCHER = _ft_launcher()
pytestmark = pytest.mark.skipif(FT_LAUNCHER is None, reason="ft_launcher script not found next to the interpreter")

TRAIN = str(ROOT / "examples" / "train_nvrx.py")
STEPS = 20
RLSUP_FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "3"]
# NIC monitoring needs NVML (a GPU driver); off, so CPU runs do not log NVML tracebacks.
FT_ARGS = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--ft-enable-nic-monitor", "false"]
DIGEST = re.compile(r"\[train_nvrx\] done at step (\d+);.*weights sha256 ([0-9a-f]{16})")


def _rlsup_ft(workdir: Path, *train_args: str, timeout: float = 90):
    return run_rlsup(["run", *RLSUP_FAST, "--", FT_LAUNCHER, *FT_ARGS, TRAIN, "--steps", str(STEPS),
                      "--checkpoint-every", "5", *train_args], workdir, timeout=timeout, OMP_NUM_THREADS="1")


def _done(stdout: str) -> tuple[int, str]:
    found = DIGEST.findall(stdout)
    assert len(found) == 1, stdout[-3000:]
    return int(found[0][0]), found[0][1]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("nvrx_clean")
    return workdir, _rlsup_ft(workdir)


def test_ft_launcher_runs_to_completion_under_rlsup(clean_run) -> None:
    workdir, r = clean_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[train_nvrx] attempt 0: starting at step 0 (world 2, nvrx on, ft restart count 0)" in r.stdout
    assert _done(r.stdout)[0] == STEPS
    assert incidents(workdir / ".rlsup") == []
    assert "succeeded after 1 attempt(s); exit 0" in r.stderr
    # both ranks heartbeated to rlsup (trainer_hooks) while NVRx's client was connected
    hb = sorted(p.name for p in (workdir / ".rlsup" / "attempts" / "attempt_0000" / "heartbeats").glob("*.hb"))
    assert hb == ["rank_00000.hb", "rank_00001.hb"]
    assert (workdir / "checkpoints" / f"step_{STEPS:09d}").is_dir()


def test_crash_restarted_by_rlsup_resumes_from_checkpoint(workdir: Path, clean_run) -> None:
    r = _rlsup_ft(workdir, "--crash-at-step", "13", "--fault-rank", "1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "[train_nvrx] rank 1: injected crash after step 13" in out
    # ft_launcher did not restart (--max-restarts 0): rlsup did, with a new ft_launcher whose count is 0 again
    assert "attempt 1: starting at step 10 (world 2, nvrx on, ft restart count 0)" in out
    assert "succeeded after 2 attempt(s); exit 0" in r.stderr
    inc = incidents(workdir / ".rlsup")
    assert len(inc) == 1, inc
    assert inc[0]["attempt"] == 0 and inc[0]["action"] == "restart"
    # rlsup saw rank 1 die itself and ended the attempt without waiting for ft_launcher to notice (its
    # failure line is read when it does report first: tests/diagnosis/test_attempt_end.py)
    assert inc[0]["reason"] == "signal" and inc[0]["signal"] == "SIGKILL", inc[0]
    assert inc[0]["rank"] == 1 and inc[0]["last_step"] == 13
    assert "without waiting for the launcher" in inc[0]["detail"] or inc[0]["exit_code"] == 1, inc[0]
    assert inc[0]["resumed_step"] == 10 and inc[0]["resumed_from"].endswith("step_000000010")
    # the resumed run ends with the same weights as the run that never failed
    assert _done(out) == _done(clean_run[1].stdout)
