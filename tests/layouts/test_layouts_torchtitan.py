"""torchtitan ``step-N`` trees written the way torchtitan's CheckpointManager writes them
(tests/source_builders.py, from torchtitan/components/checkpointer/dcp.py @b5bcd76), with real DCP saves,
and a mid-save kill matrix: every prefix of a save, real SIGKILLs agreeing with the in-process stops."""

from __future__ import annotations

from pathlib import Path

import pytest
import layout_builders as lb
import source_builders as sb

from supervisor import layouts
from supervisor.layouts import torchtitan


def _base(tmp_path: Path, steps: tuple[int, ...] = (10, 20), keep: int = 0) -> Path:
    base = tmp_path / "base"
    for s in steps:
        sb.run_ops(base, lambda: sb.torchtitan_save(base, s, keep_latest_k=keep))
    return base


def test_complete_tree_is_torchtitan_and_plain_dcp_roots_stay_dcp(tmp_path: Path) -> None:
    base = _base(tmp_path)
    assert layouts.detect_layout(base) == "torchtitan"
    best = layouts.latest_valid(base)
    assert best is not None and best.step == 20 and best.layout == "torchtitan"
    rec = layouts.verify_path(base / "step-20")
    assert rec.valid and rec.layout == "torchtitan" and rec.step == 20
    plain = tmp_path / "plain"
    lb.dcp_save(plain / "step-100")  # tiny_state keys: no torchtitan training state
    assert layouts.detect_layout(plain) == "dcp"
    assert not torchtitan.owns(plain / "step-100")


def test_kill_matrix_every_prefix_of_a_save_with_purge(tmp_path: Path) -> None:
    """keep_latest_k=2: save step-30 (mkdir, shard, .metadata.tmp, rename) then purge step-10 (rmtree)."""
    base = _base(tmp_path, keep=2)
    seen = []
    for k, root, events in sb.prefix_trees(base, tmp_path / "m", lambda r: sb.torchtitan_save(r, 30, keep_latest_k=2)):
        committed = k > sb.index_of(events, "os.rename", "step-30/.metadata.tmp")
        best = layouts.latest_valid(root)
        assert best is not None and best.step == (30 if committed else 20), (k, events[k - 1])
        # torchtitan's own pick agrees under kills: .metadata is renamed in last
        assert sb.torchtitan_find_load_step(root) == best.step
        seen.append(events[k - 1][0])
    assert {"os.mkdir", "open", "os.rename", "shutil.rmtree"} <= set(seen)


def test_overwriting_a_step_killed_mid_shard_is_picked_by_torchtitan_not_rlsup(tmp_path: Path) -> None:
    """Re-saving an existing step-N (a rewind with --checkpoint.load_step, then training to N again): DCP
    rewrites the shards under the OLD .metadata and replaces it only in finish(). A kill inside the shard
    write (the half-written variant: the file opened at event k-1 cut to half) leaves old .metadata + a
    short shard: torchtitan's _find_load_step takes it, rlsup sees the shard is shorter than .metadata says."""
    base = _base(tmp_path, steps=(10, 20, 30))
    probe = lb.copy_tree(base, tmp_path / "probe")
    events = sb.rel_events(sb.run_ops(probe, lambda: sb.torchtitan_save(probe, 30)))
    k = sb.index_of(events, "open", ".metadata.tmp")  # kill before .metadata.tmp: the shard open was k-1
    assert events[k - 2][1][0].endswith(".distcp")
    root = lb.copy_tree(base, tmp_path / "k")
    sb.run_ops(root, lambda: sb.torchtitan_save(root, 30), stop_at=k)
    lb.truncate(root / events[k - 2][1][0], 0.5)
    assert sb.torchtitan_find_load_step(root) == 30  # the bug rlsup protects against
    rec = layouts.verify_path(root / "step-30")
    assert not rec.valid and "truncated" in rec.reason
    assert layouts.latest_valid(root).step == 20


def test_model_only_and_hf_last_saves_are_not_resumable(tmp_path: Path) -> None:
    base = _base(tmp_path)
    sb.torchtitan_save(base, 30, last="model_only")
    assert sb.torchtitan_find_load_step(base) == 30  # torchtitan would try a full load from it
    rec = layouts.verify_path(base / "step-30")
    assert not rec.valid and "model-only" in rec.reason
    assert layouts.latest_valid(base).step == 20
    sb.torchtitan_save(base, 40, last="hf")
    assert (base / "step-40" / torchtitan.HF_INDEX).exists()
    assert sb.torchtitan_find_load_step(base) == 40
    rec = layouts.verify_path(base / "step-40")
    assert not rec.valid and "HF safetensors export" in rec.reason
    assert layouts.latest_valid(base).step == 20


def test_hf_export_kill_matrix_and_torn_index(tmp_path: Path) -> None:
    """The HF export's index is written last with a plain open("w"): torn, torchtitan still takes it."""
    base = _base(tmp_path)
    for k, root, events in sb.prefix_trees(base, tmp_path / "m", lambda r: sb.torchtitan_save(r, 40, last="hf")):
        index_written = k > sb.index_of(events, "open", torchtitan.HF_INDEX)
        assert sb.torchtitan_find_load_step(root) == (40 if index_written else 20)
        assert layouts.latest_valid(root).step == 20, (k, events[k - 1])
        if k > 1 and events[k - 2][0] == "open" and (root / events[k - 2][1][0]).is_file():
            lb.truncate(root / events[k - 2][1][0], 0.5)
            assert layouts.latest_valid(root).step == 20
    root = tmp_path / "m" / "full"
    lb.truncate(root / "step-40" / torchtitan.HF_INDEX, 0.5)
    assert sb.torchtitan_find_load_step(root) == 40
    rec = layouts.verify_path(root / "step-40")
    assert not rec.valid and torchtitan.HF_INDEX in rec.reason


def test_seed_checkpoint_step0_is_model_only_and_valid(tmp_path: Path) -> None:
    root = tmp_path / "r"
    sb.torchtitan_save(root, 0, last="model_only")
    sb.torchtitan_save(root, 10)
    rec = layouts.verify_path(root / "step-0")
    assert rec.valid and any("seed checkpoint" in n for n in rec.notes)


def test_empty_and_torn_steps_never_raise(tmp_path: Path) -> None:
    base = _base(tmp_path)
    (base / "step-30").mkdir()
    (base / "step-40").mkdir()
    (base / "step-40" / ".metadata").write_bytes(b"")
    recs = {r.step: r for r in layouts.scan(base)}
    assert not recs[30].valid and ".metadata missing" in recs[30].reason
    assert not recs[40].valid and "empty" in recs[40].reason
    assert layouts.latest_valid(base).step == 20


@pytest.mark.parametrize("steps", [5])
def test_bench_tree_newest_is_broken(tmp_path: Path, steps: int) -> None:
    sb.torchtitan_bench_tree(tmp_path, steps)
    assert layouts.detect_layout(tmp_path) == "torchtitan"
    assert not layouts.verify_path(tmp_path / f"step-{steps}").valid
    assert layouts.latest_valid(tmp_path).step == steps - 1


