"""The repository's paths and the environment tests give rlsup and the jobs it runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
TESTS = ROOT / "tests"
JOBS = TESTS / "jobs"
TRAIN = str(ROOT / "examples" / "train_tiny.py")  # the example trainer most end-to-end tests run
PY = sys.executable
BIN = Path(sys.executable).parent  # the venv's console scripts (torchrun, trl, pykeen, ...)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any ``RLSUP_*`` setting (a developer's own must not leak into a test),
    unbuffered output, no metrics port unless a test passes its own, the repository importable; then ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSUP_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["RLSUP_METRICS_PORT"] = "0"  # tests that scrape pass their own free port
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def job_env(workdir: Path, **extra: str) -> dict[str, str]:
    """clean_env with the venv's console scripts first on PATH (``trl``, ``torchrun``, ``python``), offline HF
    libraries, and this test's own datasets cache (another test's cache is never mapped by our ranks)."""
    return clean_env(PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                     HF_DATASETS_CACHE=str(workdir / "hf-datasets-cache"), TOKENIZERS_PARALLELISM="false",
                     OMP_NUM_THREADS="1", **extra)
