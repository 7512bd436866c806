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
from pathlib import Path

import pytest

from rlsup_format.manifest import manifest_name, read_manifest
from rlsup_format.names import step_dir_name
from support.world_phases import Phase, check_data_order, consumed, run_chain, same_state

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


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model, backend, count", [("ddp", "torch", 3), ("fsdp", "dcp", 2)])
def test_a_changed_world_keeps_state_data_order_and_determinism(workdir: Path, model: str, backend: str,
                                                                 count: int) -> None:
    changed, reference = workdir / "changed", workdir / "reference"
    run, ref = phases(count, lose=True), phases(count, lose=False)
    last = run[-1].kept[-1]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ref_run = pool.submit(run_chain, reference, ref, model, backend)  # alongside: they share only the cores
        outputs = run_chain(changed, run, model, backend, reference=False)  # the chain under test
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
