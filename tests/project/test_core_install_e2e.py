"""``pip install .`` gives a working rlsup: its CLI, a supervised run through a crash and its checkpoints work
with the core dependencies alone (pyproject's ``[project] dependencies``), every extra in this venv made to
look absent (tests/support/core_only.py). The README's first command (set-up ``--core``, then the demo under
torchrun) is run the same way by tests/project/test_readme_commands_e2e.py."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from support.core_only import core_dependencies, core_only, core_only_env, refused
from support.env import BIN, PY, TRAIN

# What rlsup imports from its core dependencies, and what the extras bring; the first must stay importable and
# every one of the second that this venv holds must be refused (a refusal list derived wrongly fails here).
CORE_IMPORTS = ("torch", "numpy", "yaml", "xxhash", "psutil", "watchdog", "prometheus_client", "aiohttp")
EXTRA_IMPORTS = ("transformers", "trl", "accelerate", "datasets", "deepspeed", "lightning", "megatron",
                 "nvidia_resiliency_ext", "pynvml", "ray", "verl", "s3fs", "moto", "pytest", "torchdata")
OURS = ("supervisor", "trainer_hooks", "rlsup_format")


def test_the_core_set_is_pyprojects_and_every_installed_extra_looks_absent(tmp_path: Path) -> None:
    found = core_only()
    assert {canonicalize_name(Requirement(r).name) for r in core_dependencies()} <= found.core
    assert not found.blocked & set(CORE_IMPORTS), found.blocked & set(CORE_IMPORTS)
    installed = md.packages_distributions()
    present = [m for m in EXTRA_IMPORTS if m in installed]
    assert "pytest" in present and set(present) <= found.blocked, set(present) - found.blocked

    env, log = core_only_env(tmp_path)
    probe = ("import importlib.util, sys\nimport " + ", ".join(CORE_IMPORTS) +
             "\nprint([m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None])\nimport pytest")
    out = subprocess.run([PY, "-c", probe, *present], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr  # the core imports, find_spec sees no extra
    assert out.returncode == 1 and "ModuleNotFoundError: No module named 'pytest'" in out.stderr, out.stderr
    assert "pytest asked by __main__" in log.read_text()


def test_rlsup_works_with_its_core_dependencies_alone(tmp_path: Path) -> None:
    """The console script ``pip install`` makes: help, the config reference, a supervised one-process run of the
    example trainer killed once and resumed, its newest checkpoint and its status; rlsup's own code asks for
    no module of an extra on the way (an optional one it probes would be listed here with its reason)."""
    env, log = core_only_env(tmp_path, OMP_NUM_THREADS="1")
    rlsup = str(BIN / "rlsup")

    def run(*args: str) -> str:
        out = subprocess.run([rlsup, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, (args, out.stdout + out.stderr, refused(log))
        return out.stdout

    assert "demo" in run("--help")
    assert "checkpoint_dir" in run("config", "reference")
    ran = run("run", "--checkpoint-dir", "ckpts", "--state-dir", "state", "--backoff-initial", "0.05",
              "--kill-grace", "2", "--", PY, TRAIN, "--steps", "6", "--checkpoint-every", "3",
              "--crash-at-step", "4", "--fault-rank", "0")
    assert run("checkpoints", "latest", "ckpts").strip().endswith("step_000000006"), ran
    assert "attempt 0" in run("status", "--state-dir", "state")
    ours = [line for line in refused(log) if line.split(" asked by ")[1].split(".")[0] in OURS]
    assert not ours, ours
