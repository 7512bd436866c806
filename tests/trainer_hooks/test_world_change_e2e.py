"""A run that changes world size, with real torchrun (gloo, CPU, --standalone): 3 ranks, then 2 from the 3-rank
save (tests/jobs/world_change_job.py), for DDP with the torch backend (then 3 again from the 2-rank save) and for
FSDP2 (``fully_shard``) with the dcp backend (each torchrun costs seconds: the grow is run once).

Each phase of the run under test goes on past its last save (those steps are lost, as when a node dies), and the
next phase restores that save into the other world size. The reference, run alongside, stops each phase at its
save. Both must end with equal weights: what a restore into another world loads depends on the save alone. The
state right after each restore equals, whole, the state at the save; and the sample ids every rank consumed, over
the kept steps of the whole run, are each step's slice of its epoch's permutation (the data position is global).
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rlsup_format.manifest import manifest_name, read_manifest
from rlsup_format.names import step_dir_name
from support.env import JOBS, clean_env

JOB = str(JOBS / "world_change_job.py")
N, GLOBAL, SEED = 60, 12, 7  # the job's dataset size, global batch and sampler seed
STEPS_PER_EPOCH = N // GLOBAL


@dataclass(frozen=True)
class Phase:
    world: int
    until: int
    save_at: tuple[int, ...]
    kept: range  # the steps of this phase the run keeps (later ones are lost: the next phase restores before them)


PLAN = ((3, 8), (2, 12), (3, 18))  # (world size, the step the phase saves at and the next one restores)
LOST = 2  # steps a phase of the run under test takes after its save, lost when the next phase restores


def phases(count: int, lose: bool) -> tuple[Phase, ...]:
    """The first ``count`` phases of PLAN; the last one ends at its step, without a save."""
    out = []
    for i, (world, end) in enumerate(PLAN[:count]):
        last = i == count - 1
        begin = PLAN[i - 1][1] if i else 0
        out.append(Phase(world, end + (LOST if lose and not last else 0), () if last else ((4, end) if i == 0 else (end,)),
                         range(begin + 1, end + 1)))
    return tuple(out)


def run_chain(root: Path, chain: tuple[Phase, ...], model: str, backend: str) -> list[str]:
    """Each phase as one torchrun; returns each phase's output."""
    (root / "logs").mkdir(parents=True)
    (root / "dump").mkdir()
    outputs = []
    for i, phase in enumerate(chain):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(phase.world), JOB,
               "--model", model, "--backend", backend, "--checkpoint-dir", str(root / "ckpt"), "--until",
               str(phase.until), "--save-at", ",".join(map(str, phase.save_at)), "--log-dir", str(root / "logs"),
               "--tag", f"p{i}", "--dump-dir", str(root / "dump"), "--out", str(root / "final.pt")]
        proc = subprocess.run(cmd, env=clean_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240,
                              cwd=root)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"phase {i} ({phase.world} ranks): {output[-6000:]}"
        outputs.append(output)
    return outputs


def consumed(root: Path, chain: tuple[Phase, ...]) -> dict[int, tuple[int, list[int]]]:
    """{step: (epoch, every id the ranks consumed in it)} over the kept steps of every phase."""
    steps: dict[int, tuple[set[int], list[int]]] = {}
    for i, phase in enumerate(chain):
        files = sorted((root / "logs").glob(f"ids.p{i}.rank*"))
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


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model, backend, count", [("ddp", "torch", 3), ("fsdp", "dcp", 2)])
def test_a_changed_world_keeps_state_data_order_and_determinism(workdir: Path, model: str, backend: str,
                                                                 count: int) -> None:
    changed, reference = workdir / "changed", workdir / "reference"
    run, ref = phases(count, lose=True), phases(count, lose=False)
    last = run[-1].kept[-1]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ref_run = pool.submit(run_chain, reference, ref, model, backend)  # alongside: they share only the cores
        outputs = run_chain(changed, run, model, backend)
        ref_outputs = ref_run.result()
    changes = [None, "WORLD_CHANGE 8 3 2", "WORLD_CHANGE 12 2 3"][:count]
    for out in (outputs, ref_outputs):
        for output, change in zip(out, changes):
            assert (change in output) if change else ("WORLD_CHANGE" not in output), output[-3000:]

    # The model and optimizer state right after each restore is, whole, the state at the save.
    dump = changed / "dump"
    for step, saved_world, world in [(8, 3, 2), (12, 2, 3)][:count - 1]:
        assert same_state(dump / f"saved.step{step}.world{saved_world}.pt",
                          dump / f"restored.step{step}.world{world}.pt") == []
        manifests = [read_manifest(changed / "ckpt" / step_dir_name(step) / manifest_name(r))
                     for r in range(saved_world)]
        assert all(m.world_size == saved_world and m.resizable for m in manifests)
    # Lost steps change nothing: the run ends as the reference, which never took them.
    assert same_state(changed / "final.pt", reference / "final.pt") == []
    for root, chain in ((changed, run), (reference, ref)):
        check_data_order(consumed(root, chain), last)
