"""A run of tests/jobs/world_change_job.py in phases of different world sizes, and what a test checks across
them: the reference chain of plain torchruns (:func:`run_chain`), the sample ids the ranks consumed over the
kept steps (:func:`consumed`), that they are every sample of each epoch once, in order (:func:`check_data_order`),
and whether two whole-state dumps are equal (:func:`same_state`). Shared by the single-host world change test
(tests/trainer_hooks/test_world_change_e2e.py) and the multi-node shrink (tests/cluster/test_shrink_e2e.py)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from support.env import JOBS, clean_env
from support.forked_ranks import ForkedPhase, run_phases

JOB = str(JOBS / "world_change_job.py")
N, GLOBAL, SEED = 60, 12, 7  # the job's dataset size, global batch and sampler seed
STEPS_PER_EPOCH = N // GLOBAL


@dataclass(frozen=True)
class Phase:
    world: int
    until: int
    save_at: tuple[int, ...]
    kept: range  # the steps of this phase the run keeps (later ones are lost: the next phase restores before them)


def run_chain(root: Path, chain: tuple[Phase, ...], model: str, backend: str, reference: bool = True) -> list[str]:
    """Each phase's ranks in turn; returns each phase's output. A ``reference`` chain is the tests' plain-torch
    side, not what they test: its phases' ranks are forked by one driver (:mod:`support.forked_ranks`: one
    ``import torch`` for the chain; its ranks end without torch's teardown, where a plain torchrun's rank aborted
    about once in 2,000 runs, pytorch/pytorch#179291). A chain under test (``reference`` False) runs each phase
    as a real torchrun."""
    return (_run_forked if reference else _run_torchruns)(root, chain, model, backend)


def _job_args(root: Path, i: int, phase: Phase, model: str, backend: str) -> list[str]:
    """world_change_job's arguments for phase ``i``: the chain's directories, the phase's steps and saves."""
    return ["--model", model, "--backend", backend, "--checkpoint-dir", str(root / "ckpt"), "--until",
            str(phase.until), "--save-at", ",".join(map(str, phase.save_at)), "--log-dir", str(root / "logs"),
            "--tag", f"p{i}", "--dump-dir", str(root / "dump"), "--out", str(root / "final.pt")]


def _run_torchruns(root: Path, chain: tuple[Phase, ...], model: str, backend: str) -> list[str]:
    (root / "logs").mkdir(parents=True)
    (root / "dump").mkdir()
    outputs = []
    for i, phase in enumerate(chain):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(phase.world), JOB,
               *_job_args(root, i, phase, model, backend)]
        proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=240, cwd=root)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"phase {i} ({phase.world} ranks): {output[-6000:]}"
        outputs.append(output)
    return outputs


def _run_forked(root: Path, chain: tuple[Phase, ...], model: str, backend: str) -> list[str]:
    (root / "logs").mkdir(parents=True)
    (root / "dump").mkdir()
    (root / "ranks").mkdir()
    phases = [ForkedPhase(phase.world, tuple(_job_args(root, i, phase, model, backend)), str(root / "ranks" / f"p{i}"))
              for i, phase in enumerate(chain)]
    return run_phases(JOB, phases, root, clean_env(), timeout=120 * len(chain))


def consumed(root: Path, chain: tuple[Phase, ...]) -> dict[int, tuple[int, list[int]]]:
    """{step: (epoch, every id the ranks consumed in it)} over the kept steps of every phase of a
    :func:`run_chain` run (phase ``i``'s ranks log to ``<root>/logs/ids.p<i>.rank<R>``)."""
    return consumed_from([sorted((root / "logs").glob(f"ids.p{i}.rank*")) for i in range(len(chain))], chain)


def consumed_from(logs: Sequence[Sequence[Path]], chain: tuple[Phase, ...]) -> dict[int, tuple[int, list[int]]]:
    """:func:`consumed` from each phase's id logs, one per rank, wherever they lie (``logs[i]``: phase ``i``'s;
    on several nodes each node's directory holds its own ranks' logs)."""
    steps: dict[int, tuple[set[int], list[int]]] = {}
    for phase, files in zip(chain, logs, strict=True):
        assert len(files) == phase.world, files
        for path in files:
            for line in path.read_text().splitlines():
                step, epoch, *ids = map(int, line.split())
                if step in phase.kept:
                    epochs, seen = steps.setdefault(step, (set(), []))
                    epochs.add(epoch)
                    seen.extend(ids)
    assert all(len(epochs) == 1 for epochs, _ in steps.values()), "a step drew from two epochs"
    return {step: (epochs.pop(), ids) for step, (epochs, ids) in sorted(steps.items())}


def permutation(epoch: int) -> list[int]:
    """The epoch's order, as ResumableSampler (and DistributedSampler) draws it."""
    return torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()


def check_data_order(steps: dict[int, tuple[int, list[int]]], last: int) -> None:
    """Step s takes the next GLOBAL ids of its epoch's permutation, whatever the world: across the run every
    sample of an epoch is consumed exactly once, in the epoch's order."""
    assert sorted(steps) == list(range(1, last + 1))
    per_epoch: dict[int, Counter] = {}
    for step, (epoch, ids) in steps.items():
        assert epoch == (step - 1) // STEPS_PER_EPOCH, (step, epoch)
        j = (step - 1) % STEPS_PER_EPOCH
        assert sorted(ids) == sorted(permutation(epoch)[j * GLOBAL:(j + 1) * GLOBAL]), f"step {step}"
        per_epoch.setdefault(epoch, Counter()).update(ids)
    for epoch, counts in per_epoch.items():
        assert max(counts.values()) == 1, f"epoch {epoch} repeats {[i for i, c in counts.items() if c > 1]}"
        finished = (epoch + 1) * STEPS_PER_EPOCH <= last
        assert len(counts) == (N if finished else (last % STEPS_PER_EPOCH) * GLOBAL), epoch


def same_state(a: Path, b: Path) -> list[str]:
    """Names whose tensors differ between two whole-state dumps."""
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert x.keys() == y.keys() and x
    return [k for k in x if not torch.equal(x[k], y[k])]
