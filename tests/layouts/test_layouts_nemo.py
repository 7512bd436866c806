"""NeMo 2 checkpoint trees written the way NeMo's ModelCheckpoint + MegatronCheckpointIO write them
(tests/source_builders.py, from nemo/lightning/pytorch/callbacks/model_checkpoint.py @8cfedd7), with
``weights/`` from a real megatron-core save, and a mid-save kill matrix against AutoResume's own pick."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import pytest
import layout_builders as lb
import source_builders as sb
from support.template_cache import cached, version_of

from supervisor import layouts
from supervisor.layouts import nemo

B_TOPK = sb.nemo_name(2)
B_LAST = sb.nemo_name(2, last=True)


@pytest.fixture(scope="module", autouse=True)
def mcore_template() -> Iterator[Path]:
    """One real megatron-core save, its file operations recorded; every tree replays it. Kept between runs
    (support.template_cache): the save imports megatron-core and costs seconds."""
    def build(into: Path) -> None:
        ops = sb.run_ops(into, lambda: lb.mcore_save(into / "weights", seed=1))
        (into / "events.json").write_text(json.dumps([[e, [Path(q).name for q in paths]] for e, paths in ops.events]))

    saved = cached(f"nemo-mcore-save_{version_of('megatron-core', 'torch')}", build)
    target = saved / "weights"
    os.environ[sb.MCORE_TEMPLATE_ENV] = str(target)
    _REAL_MCORE_EVENTS[:] = [(e, tuple(paths)) for e, paths in json.loads((saved / "events.json").read_text())]
    yield target
    os.environ.pop(sb.MCORE_TEMPLATE_ENV, None)


_REAL_MCORE_EVENTS: list[tuple[str, tuple[str, ...]]] = []


def test_mcore_replay_follows_the_real_save(mcore_template: Path) -> None:
    """The replay's order is the real save's: the shards are written by MCore's forked workers (outside
    this process's count; a kill_matrix recording shows them between the two mkdirs' successor and
    .metadata.tmp), everything else must match one for one."""
    seen = [Path(p[0]).name if e == "open" else e.removeprefix("os.") for e, p in _REAL_MCORE_EVENTS]
    assert seen == [op for op in sb.MCORE_ORDER if not op.endswith(".distcp")]
    assert sorted(p.name for p in mcore_template.glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp"]


def _base(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    sb.run_ops(base, lambda: sb.nemo_save(base, 1))
    return base


def _save_b(root: Path) -> None:
    sb.nemo_save(root, 2, previous_last=1)


def test_complete_tree(tmp_path: Path) -> None:
    base = _base(tmp_path)
    _save_b(base)
    assert layouts.detect_layout(base) == "nemo"
    best = layouts.latest_valid(base)
    assert best is not None and best.step == 2 and best.path.name == B_LAST and best.role == "last"
    assert sb.nemo_autoresume_pick(base) == base / B_LAST
    rec = layouts.verify_path(base / B_TOPK)
    assert rec.valid and rec.layout == "nemo" and rec.step == 2 and rec.role is None
    assert not (base / sb.nemo_name(1, last=True)).exists()  # the previous -last was removed


def test_kill_matrix_every_prefix_of_a_save(tmp_path: Path) -> None:
    """Step 2 saved over step 1: top-k save, -last save, removal of step 1's -last, stopped before each
    file operation. rlsup takes step 2 once a directory of it lost its marker; AutoResume is never
    wrong under a kill (it skips marked directories), but it resumes from step 1's -last while a complete
    step 2 (top-k) exists, and rlsup resumes from that."""
    base = _base(tmp_path)
    lag, kinds = [], set()
    for k, root, events in sb.prefix_trees(base, tmp_path / "m", _save_b):
        topk_done = k > sb.index_of(events, "os.remove", B_TOPK + nemo.MARKER_SUFFIX)
        last_done = k > sb.index_of(events, "os.remove", B_LAST + nemo.MARKER_SUFFIX)
        before = sb.tree_names(root)
        best = layouts.latest_valid(root)
        assert sb.tree_names(root) == before  # rlsup reads only, markers and all
        assert best is not None and best.step == (2 if topk_done else 1), (k, events[k - 1])
        if topk_done:
            assert best.path.name == (B_LAST if last_done else B_TOPK)
        assert not nemo.marker_of(best.path).exists()
        pick = sb.nemo_autoresume_pick(root)
        assert pick is not None and layouts.verify_path(pick).valid, (k, pick)
        if nemo.step_of(pick) < best.step:
            lag.append(k)
        event, path = events[k - 1][0], events[k - 1][1][0]
        kinds.add(event if event != "open" else "marker" if path.endswith(nemo.MARKER_SUFFIX) else Path(path).suffix)
    assert lag, "AutoResume should trail rlsup while only step 2's top-k copy is finished"
    assert {"os.mkdir", "os.rename", "os.remove", "shutil.rmtree", "marker", ".pt", ".distcp", ".tmp", ".json",
            ".yaml"} <= kinds


def test_markers_lost_autoresume_takes_a_broken_last_rlsup_does_not(tmp_path: Path) -> None:
    """A tree copied without its ``-unfinished`` files (``cp -r <dirs>``, a sync that filters them, a
    marker on another filesystem): AutoResume then takes the half-written ``-last``; rlsup's file checks
    reject it, also when the kill landed inside a file (the one opened at event k-1 cut to half)."""
    base = _base(tmp_path)
    broken_picks = 0
    for k, root, events in sb.prefix_trees(base, tmp_path / "m", _save_b):
        if not (root / B_LAST).is_dir() or k > sb.index_of(events, "os.remove", B_LAST + nemo.MARKER_SUFFIX):
            continue
        prev = events[k - 2]
        # model.yaml is for people (AutoResume restores from io.json): a torn one is not detected, see docs
        torn = prev[0] == "open" and not prev[1][0].endswith(".yaml") and (root / prev[1][0]).is_file()
        if torn and (root / prev[1][0]).stat().st_size:
            lb.truncate(root / prev[1][0], 0.5)
        for marker in root.glob("*" + nemo.MARKER_SUFFIX):
            marker.unlink()
        complete = k == sb.index_of(events, "os.remove", B_LAST + nemo.MARKER_SUFFIX)
        if sb.nemo_autoresume_pick(root) == root / B_LAST and not complete:
            broken_picks += 1
        rec = layouts.verify_path(root / B_LAST)
        assert rec.valid == complete, (k, prev, rec.reason)
        best = layouts.latest_valid(root)
        assert best is not None and best.path.name in (B_TOPK, B_LAST) and best.valid
    assert broken_picks > 0  # the bug rlsup protects against


def test_first_save_killed_in_its_last_copy_autoresume_refuses(tmp_path: Path) -> None:
    """No earlier -last: killed while writing the first -last, AutoResume raises ("Last checkpoint is
    unfinished") although the top-k copy of the same step is complete; rlsup resumes from that copy."""
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = 0
    for _k, root, _events in sb.prefix_trees(empty, tmp_path / "m", lambda r: sb.nemo_save(r, 1)):
        if not (root / sb.nemo_name(1, last=True)).is_dir():
            continue
        try:
            pick = sb.nemo_autoresume_pick(root)
        except sb.NemoResumeError:
            refused += 1
            best = layouts.latest_valid(root)
            assert best is not None and best.path.name == sb.nemo_name(1)
            continue
        assert pick is not None and layouts.verify_path(pick).valid
    assert refused > 0


def test_unfinished_marker_is_reported_and_left_alone(tmp_path: Path) -> None:
    base = _base(tmp_path)
    marker = nemo.marker_of(base / sb.nemo_name(1))
    marker.touch()  # e.g. NeMo began deleting it (top-k pruning) and died
    stamp = (marker.stat().st_mtime_ns, (base / sb.nemo_name(1)).stat().st_mtime_ns)
    rec = layouts.verify_path(base / sb.nemo_name(1))
    assert not rec.valid and nemo.MARKER_SUFFIX in rec.reason
    assert layouts.latest_valid(base).path.name == sb.nemo_name(1, last=True)
    layouts.scan(base)
    assert marker.exists() and (marker.stat().st_mtime_ns, (base / sb.nemo_name(1)).stat().st_mtime_ns) == stamp
    assert not nemo.owns(marker) and nemo.step_of(marker) is None


def test_ema_copy_is_not_a_resume_point_and_shares_the_marker(tmp_path: Path) -> None:
    base = _base(tmp_path)
    ema = lb.copy_tree(base / sb.nemo_name(1, last=True), base / (sb.nemo_name(1, last=True) + "-EMA"))
    rec = layouts.verify_path(ema)
    assert not rec.valid and "EMA copy" in rec.reason
    assert nemo.marker_of(ema) == nemo.marker_of(base / sb.nemo_name(1, last=True))
    assert layouts.latest_valid(base).path.name == sb.nemo_name(1, last=True)


def test_torn_context_and_weights_without_markers(tmp_path: Path) -> None:
    base = _base(tmp_path)
    d = base / sb.nemo_name(1, last=True)
    (d / "context" / "io.json").write_text("")
    assert "io.json is empty" in layouts.verify_path(d).reason
    (d / "weights" / "metadata.json").unlink()
    assert "metadata.json missing" in layouts.verify_path(d).reason
    assert layouts.latest_valid(base).path.name == sb.nemo_name(1)


def test_bench_tree_newest_is_broken(tmp_path: Path) -> None:
    sb.nemo_bench_tree(tmp_path, 5)
    assert layouts.detect_layout(tmp_path) == "nemo"
    newest = tmp_path / sb.nemo_name(5, last=True)
    assert nemo.marker_of(newest).exists() and not layouts.verify_path(newest).valid
    assert layouts.latest_valid(tmp_path).step == 4


