"""NeMo-RL ``step_N`` trees written the way NeMo-RL's CheckpointManager and GRPO loop write them
(tests/source_builders.py, from nemo_rl/utils/checkpoint.py @01e9028), with real DCP and torch.save
writers, and a mid-save kill matrix: every prefix of a save, real SIGKILLs agreeing with in-process stops."""

from __future__ import annotations

import json
from pathlib import Path

import layout_builders as lb
import source_builders as sb

from supervisor import layouts
from supervisor.layouts import nemo_rl


def _base(tmp_path: Path, steps: tuple[int, ...] = (1,)) -> Path:
    base = tmp_path / "base"
    for s in steps:
        sb.run_ops(base, lambda: sb.nemo_rl_save(base, s))
    return base


def test_complete_steps_and_detection(tmp_path: Path) -> None:
    base = _base(tmp_path, (1, 2))
    assert layouts.detect_layout(base) == "nemo-rl"
    best = layouts.latest_valid(base)
    assert best is not None and best.step == 2 and best.path.name == "step_2" and best.layout == "nemo-rl"
    rec = layouts.verify_path(base / "step_1")
    assert rec.valid and rec.layout == "nemo-rl" and rec.step == 1


def test_kill_matrix_every_prefix_of_a_save(tmp_path: Path) -> None:
    """Save step 2 over a complete step 1 and stop before each of its file operations: tmp_step_2 is never
    taken; step_2 only once renamed in. NeMo-RL's get_latest_checkpoint_path agrees: under a kill the
    rename is its commit point, so its own pick is never broken here."""
    base = _base(tmp_path)
    kinds = set()
    for k, root, events in sb.prefix_trees(base, tmp_path / "m", lambda r: sb.nemo_rl_save(r, 2)):
        committed = k > sb.index_of(events, "os.rename", "tmp_step_2")
        best = layouts.latest_valid(root)
        assert best is not None and best.step == (2 if committed else 1), (k, events[k - 1])
        assert sb.nemo_rl_latest(root) == best.path
        if (root / "tmp_step_2").exists():
            rec = layouts.verify_path(root / "tmp_step_2")
            assert not rec.valid and "uncommitted" in rec.reason
        if k > 1 and events[k - 2][0] == "open" and (root / events[k - 2][1][0]).is_file():
            lb.truncate(root / events[k - 2][1][0], 0.5)  # the kill landed inside that write
            assert layouts.latest_valid(root).step == 1
        kinds.add(Path(events[k - 1][1][0]).suffix or events[k - 1][0])
    assert {".json", ".yaml", ".distcp", ".tmp", ".pt", "os.mkdir", "os.rename"} <= kinds


def test_committed_step_torn_after_the_rename_is_taken_by_nemo_rl_not_rlsup(tmp_path: Path) -> None:
    """torch.save, json.dump and yaml.safe_dump do not fsync, and the rename does not wait for them: after a
    node crash the rename can be on disk with the files short. get_latest_checkpoint_path looks at names
    only and returns step_2; rlsup reads the files and falls back to step_1."""
    base = _base(tmp_path, (1, 2))
    for rel in ("train_dataloader.pt", "training_info.json", "policy/weights/__0_0.distcp",
                "policy/optimizer/.metadata"):
        root = lb.copy_tree(base, tmp_path / rel.replace("/", "_"))
        lb.truncate(root / "step_2" / rel, 0.5)
        assert sb.nemo_rl_latest(root) == root / "step_2"  # the bug rlsup protects against
        rec = layouts.verify_path(root / "step_2")
        assert not rec.valid, rel
        assert layouts.latest_valid(root).step == 1


def test_resaving_an_existing_step_swaps_through_old_step(tmp_path: Path) -> None:
    """``_rename_checkpoint`` when step_2 exists: step_2 -> old_step_2, tmp_step_2 -> step_2, rmtree old.
    Killed between the two renames, step_2 is missing: rlsup and NeMo-RL both fall back to step_1
    (old_step_2 holds a complete earlier save of step 2 that NeMo-RL cannot resume from by name)."""
    base = _base(tmp_path, (1, 2))
    for k, root, events in sb.prefix_trees(base, tmp_path / "m", lambda r: sb.nemo_rl_save(r, 2)):
        best = layouts.latest_valid(root)
        assert best is not None and best.path == sb.nemo_rl_latest(root), (k, events[k - 1])
        if (root / "old_step_2").exists() and not (root / "step_2").exists():
            assert best.step == 1
            assert "uncommitted" in layouts.verify_path(root / "old_step_2").reason


def test_megatron_policy_weights(tmp_path: Path) -> None:
    root = tmp_path / "r"
    for s in (1, 2):
        step = root / f"step_{s}"
        (step / "policy" / "weights").mkdir(parents=True)
        (step / "training_info.json").write_text(json.dumps({"step": s}))
        # MCore's file set (DCP + common.pt + metadata.json); a real MCore save is exercised in test_layouts_nemo
        lb._fake_mcore(step / "policy" / "weights" / "iter_0000000", seed=s)
    (root / "step_2" / "policy" / "weights" / "iter_0000000" / "metadata.json").unlink()
    assert layouts.detect_layout(root) == "nemo-rl"
    assert "metadata.json missing" in layouts.verify_path(root / "step_2").reason
    assert layouts.latest_valid(root).step == 1


def test_never_claims_rlsup_steps(tmp_path: Path) -> None:
    root = tmp_path / "r"
    d = root / "step_000000005"
    d.mkdir(parents=True)
    (d / "manifest.rank_00000.json").write_text("{}")
    (d / "training_info.json").write_text("{}")
    assert not nemo_rl.owns(d)
    assert not nemo_rl.looks_like(root)
    assert layouts.detect_layout(root) == "rlsup"


def test_torn_and_empty_steps_never_raise(tmp_path: Path) -> None:
    base = _base(tmp_path)
    (base / "step_7").mkdir()
    (base / "step_7" / "training_info.json").write_text("")
    (base / "step_8" / "policy").mkdir(parents=True)
    (base / "step_8" / "training_info.json").write_text("{}")
    recs = {r.step: r for r in layouts.scan(base)}
    assert "empty" in recs[7].reason and "weights/ missing" in recs[8].reason
    assert layouts.latest_valid(base).step == 1


def test_bench_tree_newest_is_broken(tmp_path: Path) -> None:
    sb.nemo_rl_bench_tree(tmp_path, 5)
    assert layouts.detect_layout(tmp_path) == "nemo-rl"
    assert (tmp_path / "tmp_step_5").is_dir() and not (tmp_path / "step_5").exists()
    assert layouts.latest_valid(tmp_path).step == 4


