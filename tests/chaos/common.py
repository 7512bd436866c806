"""What the chaos scenarios share beyond tests/support: sandboxes, the example trainer's launch, and the
uninterrupted reference runs a scenario's weights and checkpoints are compared with.

The general helpers (waits, ports, process and incident helpers) come from tests/support, as everywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from rlsup_format.manifest import list_step_dirs
from support.env import PY, TRAIN, clean_env
from support.forked_ranks import ForkedPhase, run_phases


def sandbox_env(sandbox: "Sandbox | None" = None, **extra: str) -> dict[str, str]:
    """:func:`support.env.clean_env` for a chaos process: no ``__pycache__`` written into the repository by the job,
    one OpenMP thread (2 cores shared with other engineers' tests), and the sandbox's own TMPDIR and HOME."""
    dirs = {"TMPDIR": str(sandbox.tmp), "HOME": str(sandbox.home)} if sandbox is not None else {}
    return clean_env(**{"PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", **dirs, **extra})


@dataclass
class Sandbox:
    """``parent/`` (the sentinel parent: holds ``sentinel.txt`` and nothing we may write) and ``parent/run/``
    (cwd of every process; all configured directories live under it)."""

    parent: Path
    run: Path = field(init=False)
    sentinel: Path = field(init=False)
    tmp: Path = field(init=False)
    home: Path = field(init=False)

    def __post_init__(self) -> None:
        self.parent.mkdir(parents=True, exist_ok=True)
        self.run = self.parent / "run"
        self.run.mkdir(exist_ok=True)
        self.sentinel = self.parent / "sentinel.txt"
        self.sentinel.write_text("sentinel: nothing may write, read through a checkpoint, or create files here\n")
        self.tmp = self.run / "tmp"
        self.home = self.run / "home"
        self.tmp.mkdir(exist_ok=True)
        self.home.mkdir(exist_ok=True)
        from .invariants import snapshot_tree

        self.parent_snapshot = snapshot_tree(self.parent, exclude=(self.run,))

    @property
    def ckpt(self) -> Path:
        return self.run / "checkpoints"

    @property
    def state(self) -> Path:
        return self.run / ".rlsup"


STEPS = 36  # every scenario's default: the single-rank ones then share one reference run (reference_weights)
SHARED_BALLAST_MB = 6  # train_args' default ballast: that of the one single-rank reference run


def train_args(steps: int = STEPS, every: int = 3, keep_last: int = 2, ballast_mb: int = SHARED_BALLAST_MB,
               step_time: float = 0.03) -> list[str]:
    return ["--steps", str(steps), "--checkpoint-every", str(every), "--step-time", str(step_time),
            "--ballast-mb", str(ballast_mb), "--keep-last", str(keep_last)]


def launcher(world: int) -> list[str]:
    if world == 1:
        return [PY, TRAIN]
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), TRAIN]


_REF_CACHE: dict[str, dict] = {}


def _reference_key(args: list[str], *flags: str) -> list[str]:
    """``args`` less each of ``flags`` and its value, the rest as (flag, value) pairs in flag order: the same
    arguments in another order are the same run (a reference's cache key)."""
    out = list(args)
    for flag in flags:
        while flag in out:
            i = out.index(flag)
            del out[i:i + 2]
    pairs = list(zip(out[::2], out[1::2]))
    if len(out) % 2 or not all(flag.startswith("--") for flag, _ in pairs):
        return out  # not all flag-value pairs: kept as given
    return [x for pair in sorted(pairs) for x in pair]


def reference_weights(cache_dir: Path, world: int, args: list[str]) -> dict:
    """Final weights of an uninterrupted run (cached per process and on disk under ``cache_dir``).

    One rank: the final weights of :func:`reference_checkpoints`' run with the shared ballast, the run the async
    scenario compares its checkpoints with and the corruption scenario takes its checkpoints from: every
    single-rank scenario of a session compares with that one run (one torch process, not three)."""
    import torch

    # retention, the step's sleep (the run below sleeps 0) and the ballast (saved beside the model, never part of
    # it) never change the final weights: one reference for the scenarios that differ only in those
    relevant = _reference_key(args, "--keep-last", "--step-time", "--ballast-mb")
    key = hashlib.sha256(json.dumps([world, relevant]).encode()).hexdigest()[:16]
    if key in _REF_CACHE:
        return _REF_CACHE[key]
    if world == 1:
        out = reference_checkpoints(cache_dir, 1, [*relevant, "--ballast-mb", str(SHARED_BALLAST_MB)]).parent
        _REF_CACHE[key] = torch.load(out / "final.pt", weights_only=True)
        return _REF_CACHE[key]
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = cache_dir / f"reference-{key}.pt"
    if not out.exists():
        work = cache_dir / f"ref-{key}"
        shutil.rmtree(work, ignore_errors=True)  # a failed run's checkpoints would be resumed from
        work.mkdir(parents=True)
        _reference_run(work, world, [*args, "--step-time", "0", "--checkpoint-dir", str(work / "ckpt"), "--out",
                                     str(out)])
    _REF_CACHE[key] = torch.load(out, weights_only=True)
    return _REF_CACHE[key]


def same_weights(path: Path, ref: dict) -> str:
    """'' when the weights at ``path`` equal ``ref`` bit for bit, else what differs."""
    import torch

    if not path.exists():
        return f"{path} missing"
    final = torch.load(path, weights_only=True)
    if final.keys() != ref.keys():
        return f"keys differ: {sorted(final)} vs {sorted(ref)}"
    bad = [k for k in ref if not torch.equal(final[k], ref[k])]
    return f"tensors differ from the uninterrupted run: {bad}" if bad else ""


def reference_checkpoints(cache_dir: Path, world: int, args: list[str]) -> Path:
    """An uninterrupted run that keeps every checkpoint: ``<dir>/ckpt/step_N`` for each saved step (cached
    on disk under ``cache_dir``). A checkpoint of an interrupted run that verifies must hold exactly the
    state of the same step here: that is how a torn or mixed snapshot that still verifies is caught."""
    relevant = _reference_key(args, "--keep-last", "--step-time")  # the ballast stays: its payloads are compared
    key = hashlib.sha256(json.dumps(["keep-all", world, relevant]).encode()).hexdigest()[:16]
    work = cache_dir / f"refckpt-{key}"
    if (work / "final.pt").exists():
        return work / "ckpt"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    _reference_run(work, world, [*relevant, "--keep-last", "100000", "--step-time", "0", "--checkpoint-dir",
                                 str(work / "ckpt"), "--out", str(work / "final.pt.tmp")])
    os.replace(work / "final.pt.tmp", work / "final.pt")
    return work / "ckpt"


def _reference_run(work: Path, world: int, args: list[str]) -> None:
    """The example trainer uninterrupted in ``work``: one process for one rank, else ranks forked as torchrun's
    (:mod:`support.forked_ranks`: one ``import torch`` for the run, not one per rank and one for torchrun)."""
    env = sandbox_env(TMPDIR=str(work))
    if world == 1:
        r = subprocess.run([*launcher(1), *args], env=env, cwd=work, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise AssertionError(f"reference run failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
        return
    run_phases(TRAIN, [ForkedPhase(world, tuple(args), str(work / "reference"))], work, env, timeout=600)


def copy_reference_steps(ref_ckpt: Path, dest: Path, upto: int) -> None:
    """``dest`` as a run killed after step ``upto`` (between two saves) leaves it: every checkpoint of the
    uninterrupted run (:func:`reference_checkpoints`) up to that step, the same bytes that run saved."""
    dest.mkdir(parents=True, exist_ok=True)
    for step, path in list_step_dirs(ref_ckpt):
        if step <= upto:
            shutil.copytree(path, dest / path.name)


def payload_diff(got: object, want: object, where: str = "") -> str:
    """'' when two loaded checkpoint payloads are equal (tensors bit for bit), else the first difference."""
    import torch

    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
            return f"{where or '/'}: {type(got).__name__} vs {type(want).__name__}"
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            return f"{where or '/'}: tensors differ"
        return ""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return f"{where or '/'}: keys {sorted(map(str, got)) if isinstance(got, dict) else type(got).__name__} " \
                   f"vs {sorted(map(str, want))}"
        for k in want:
            d = payload_diff(got[k], want[k], f"{where}/{k}")
            if d:
                return d
        return ""
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return f"{where or '/'}: sequence lengths differ"
        for i, (a, b) in enumerate(zip(got, want)):
            d = payload_diff(a, b, f"{where}/{i}")
            if d:
                return d
        return ""
    return "" if got == want else f"{where or '/'}: {got!r:.60} vs {want!r:.60}"
