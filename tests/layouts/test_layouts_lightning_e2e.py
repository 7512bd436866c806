"""The end-to-end half of test_layouts_lightning.py (real processes, or waits on real time): lightning checkpoints:
the real ModelCheckpoint writer SIGKILLed before each file event of a save (tests/kill_matrix.py), half-written
variants, and source-derived FSDP / DeepSpeed directories."""

from __future__ import annotations



import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import kill_matrix as km
import lightning_builders as lb
from supervisor import layouts
from supervisor.layouts import lightning as lt

STEP_A, STEP_B = 2, 4


def _save_events(events: list[km.FileEvent]) -> list[km.FileEvent]:
    """The events of step B's save: from the mkdir before B's file to the event before step C's save."""
    def first(step: int) -> int:
        return next((i for i, e in enumerate(events) if any(f"step={step}.ckpt" in p for p in e.paths)), len(events))

    start, end = first(STEP_B), first(STEP_B + 2)
    start -= events[start - 1].event == "os.mkdir"
    end -= end < len(events) and events[end - 1].event == "os.mkdir"
    return events[start:end]


LINK = ("--max-steps", "4", "--every", "2", "--save-last", "link")
COPY = ("--max-steps", "6", "--every", "2", "--save-last", "copy")
SHM = Path("/dev/shm")


@dataclass
class Matrix:
    """One writer mode: its recorded events, step B's save, and ``{k: dir killed before event k}``."""

    events: list[km.FileEvent]
    save_b: list[km.FileEvent]
    runs: dict[int, Path]


def _kill_points(mode: str, save_b: list[km.FileEvent]) -> list[int]:
    """link: every event but the makedirs of the existing dirpath (a no-op: same files as the next kill
    point). copy (cross-filesystem): before each copy starts, and after the last one; the mkdir and the
    failing rename before an open leave the same files as the kill at that open."""
    if mode == "link":
        return [e.index for e in save_b if e.event != "os.mkdir"]
    opens = [e.index for e in save_b if e.event == "open"]
    return sorted({*opens, opens[-1] + 1}) if opens else []


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Matrix]:
    """Both writer modes recorded side by side, then every kill run, three at a time (the runs are
    dominated by importing Lightning, so they share the two cores)."""
    base = tmp_path_factory.mktemp("lightning-matrix")
    cross = SHM.is_dir() and SHM.stat().st_dev != base.stat().st_dev
    modes = {"link": (LINK, dict(os.environ))}
    if cross:  # $TMPDIR on another filesystem: fsspec's commit copies into the final name
        modes["copy"] = (COPY, dict(os.environ, TMPDIR=str(SHM)))

    def record(mode: str) -> tuple[str, list[km.FileEvent]]:
        d = base / mode / "record"
        return mode, km.record_events(lb.job_cmd(d, *modes[mode][0]), d, env=modes[mode][1], timeout=240)[0]

    with ThreadPoolExecutor(2) as pool:
        events = dict(pool.map(record, modes))

    def one(job: tuple[str, int]) -> tuple[tuple[str, int], Path]:
        mode, k = job
        d = base / mode / f"k{k}" / "ckpts"
        d.parent.mkdir(parents=True)
        km.run_killed_at(lb.job_cmd(d, *modes[mode][0]), d, k, env=modes[mode][1], timeout=240)
        return job, d

    save_b = {m: _save_events(ev) for m, ev in events.items()}
    jobs = [(m, k) for m in modes for k in _kill_points(m, save_b[m])]
    with ThreadPoolExecutor(3) as pool:
        dirs = dict(pool.map(one, jobs))
    return {m: Matrix(events[m], save_b[m], {k: d for (mm, k), d in dirs.items() if mm == m}) for m in modes}


def _expect(root: Path) -> int:
    """The step that must be chosen: B when its named file is complete, else A."""
    named = root / f"epoch=0-step={STEP_B}.ckpt"
    return STEP_B if named.exists() and lb.lightning_can_load(named) else STEP_A


def _check_choice(root: Path, what: str) -> layouts.CheckpointRecord:
    record = layouts.latest_valid(root)
    assert layouts.detect_layout(root) == "lightning", what
    assert record is not None and record.valid, (what, layouts.scan(root))
    assert record.step == _expect(root), (what, record, layouts.scan(root))
    assert not lt.is_last(record.path), f"{what}: the named file is preferred over last.ckpt"
    assert lb.lightning_can_load(record.path), (what, record.path)
    return record


def _lightning_breaks(root: Path, chosen: int) -> str | None:
    """Why Lightning's ckpt_path="last" would not resume from the newest complete step (None: it would)."""
    pick = lb.lightning_last_pick(root)
    if pick is None:
        return "no last.ckpt: Lightning starts from scratch"
    if not lb.lightning_can_load(pick):
        return f"{pick.name} is torn: Lightning's resume crashes"
    step = torch.load(pick, map_location="cpu", weights_only=False)["global_step"]
    return None if step == chosen else f"last.ckpt is step {step}, older than complete step {chosen}"


@pytest.mark.timeout(600)
def test_kill_matrix_save_last_link(matrix: dict[str, Matrix], tmp_path: Path) -> None:
    """save_last="link", one filesystem: the step file lands by rename; last.ckpt is removed, then
    re-linked. A kill between the two leaves no last.ckpt at all."""
    m = matrix["link"]
    assert {"os.rename", "os.remove", "os.symlink"} <= {e.event for e in m.save_b}, [e.describe() for e in m.events]
    broken = {}
    for k, d in m.runs.items():
        record = _check_choice(d, f"killed before {m.events[k - 1].describe()}")
        why = _lightning_breaks(d, record.step)
        if why:
            broken[k] = why
    assert any("from scratch" in w for w in broken.values()), broken  # killed between remove and symlink
    # half-written: a writer that writes in place (Lightning before its fsspec transaction) killed
    # inside the step-B file: rlsup falls back to A
    rename_k = next(e.index for e in m.save_b if e.event == "os.rename")
    half = tmp_path / "half" / "ckpts"
    shutil.copytree(m.runs[rename_k + 1], half, symlinks=True)
    lb.truncate_half(half / f"epoch=0-step={STEP_B}.ckpt")
    assert _check_choice(half, "step B half-written").step == STEP_A
    bad = [r for r in layouts.scan(half) if not r.valid]
    assert bad and bad[0].reason.startswith(f"epoch=0-step={STEP_B}.ckpt"), bad


@pytest.mark.timeout(600)
def test_kill_matrix_save_last_copy_cross_filesystem(matrix: dict[str, Matrix], tmp_path: Path) -> None:
    """save_last=True with $TMPDIR on another filesystem: fsspec's commit falls back to copying into
    the final name, so a kill inside the copy leaves a torn last.ckpt that Lightning resumes from."""
    if "copy" not in matrix:
        pytest.skip("needs a second filesystem (/dev/shm) for $TMPDIR")
    m = matrix["copy"]
    opens = [e for e in m.save_b if e.event == "open"]
    assert len(opens) == 2 and opens[-1].path.endswith("last.ckpt"), [e.describe() for e in m.events]
    for k, d in m.runs.items():
        _check_choice(d, f"killed before {m.events[k - 1].describe()}")
    ks = sorted(m.runs)
    broken = {}
    for e, after in zip(opens, ks[1:]):  # half-written variants: killed inside each copy
        d = tmp_path / f"half{e.index}" / "ckpts"
        shutil.copytree(m.runs[after], d, symlinks=True)
        lb.truncate_half(d / Path(e.path).name)
        record = _check_choice(d, f"half-written {Path(e.path).name}")
        why = _lightning_breaks(d, record.step)
        if why:
            broken[Path(e.path).name] = why
    assert "torn" in broken.get("last.ckpt", ""), broken


def test_last_symlink_dangling_and_copy(tmp_path: Path) -> None:
    """A last.ckpt symlink to a listed file is the same checkpoint (listed once); a dangling one is
    invalid with a reason; a last.ckpt copy is its own entry and loses a tie to the named file."""
    lb.ckpt_file(tmp_path / "epoch=0-step=2.ckpt", 2)
    os.symlink("epoch=0-step=2.ckpt", tmp_path / "last.ckpt")
    assert [p.name for _, p in lt.list_steps(tmp_path)] == ["epoch=0-step=2.ckpt"]
    assert layouts.verify_path(tmp_path / "last.ckpt").valid
    os.remove(tmp_path / "last.ckpt")
    os.symlink("epoch=0-step=9.ckpt", tmp_path / "last.ckpt")
    # (verify_path answers "does not exist" for a dangling link before asking the layout)
    (rec,) = [r for r in layouts.scan(tmp_path) if r.path.name == "last.ckpt"]
    assert not rec.valid and "dangling" in rec.reason and rec.step == 9
    assert layouts.latest_valid(tmp_path).step == 2
    os.remove(tmp_path / "last.ckpt")
    lb.ckpt_file(tmp_path / "last.ckpt", 2)
    assert [p.name for _, p in lt.list_steps(tmp_path)] == ["last.ckpt", "epoch=0-step=2.ckpt"]
    assert layouts.latest_valid(tmp_path).path.name == "epoch=0-step=2.ckpt"
    lb.ckpt_file(tmp_path / "last.ckpt", 7)  # a copy newer than every named file wins on its own step
    assert layouts.latest_valid(tmp_path).path.name == "last.ckpt"


def test_step_from_pickle_and_torn_files(tmp_path: Path) -> None:
    """Without step=S in the name the step is the pickled global_step; torn/empty/foreign files never raise."""
    lb.ckpt_file(tmp_path / "custom-name.ckpt", 11)
    assert lt.list_steps(tmp_path)[0][0] == 11 and layouts.latest_valid(tmp_path).step == 11
    (tmp_path / "empty-step=20.ckpt").write_bytes(b"")
    (tmp_path / "foreign-step=21.ckpt").write_text("hello")
    shutil.copyfile(tmp_path / "custom-name.ckpt", tmp_path / "torn-step=22.ckpt")
    lb.truncate_half(tmp_path / "torn-step=22.ckpt")
    reasons = {r.path.name: r.reason for r in layouts.scan(tmp_path) if not r.valid}
    assert "empty" in reasons["empty-step=20.ckpt"] and "not a zip" in reasons["foreign-step=21.ckpt"]
    assert "torn-step=22.ckpt" in reasons["torn-step=22.ckpt"]
    assert layouts.latest_valid(tmp_path).step == 11
    weights_only = {"global_step": 30, "epoch": 0}  # no state_dict: not resumable by Lightning
    torch.save(weights_only, tmp_path / "x-step=30.ckpt")
    assert "no state_dict" in layouts.verify_path(tmp_path / "x-step=30.ckpt").reason
    state = torch.load(lb.ckpt_template(), map_location="cpu", weights_only=False)
    for key in ("optimizer_states", "lr_schedulers"):  # what save_weights_only=True leaves out
        state.pop(key, None)
    torch.save(state, tmp_path / "w-step=31.ckpt")
    assert "weights-only" in layouts.verify_path(tmp_path / "w-step=31.ckpt").reason
    assert layouts.latest_valid(tmp_path).step == 11


def test_pickle_globals_are_never_imported(tmp_path: Path) -> None:
    """A checkpoint naming an arbitrary callable (os.system) parses to inert stubs: nothing runs."""
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    state = torch.load(lb.ckpt_template(), map_location="cpu", weights_only=False)
    state["hyper_parameters"] = {"x": Evil()}
    torch.save(state, tmp_path / "epoch=0-step=3.ckpt")
    assert layouts.latest_valid(tmp_path).step == 3
    assert not (tmp_path / "pwned").exists()


def test_versioned_roots(tmp_path: Path) -> None:
    """Lightning's default dirpath opens lightning_logs/version_N/checkpoints per restart: the run root
    is read across versions."""
    lb.ckpt_file(tmp_path / "lightning_logs/version_0/checkpoints/epoch=0-step=4.ckpt", 4)
    lb.ckpt_file(tmp_path / "lightning_logs/version_1/checkpoints/epoch=0-step=8.ckpt", 8)
    assert layouts.detect_layout(tmp_path) == "lightning"
    assert layouts.latest_valid(tmp_path).step == 8


def test_fsdp_sharded_directories(tmp_path: Path) -> None:
    """Sharded FSDP: valid only with the DCP complete and meta.pt (written last) intact."""
    good = lb.fsdp_sharded_dir(tmp_path / "epoch=0-step=2.ckpt", 2)
    assert layouts.verify_path(good).valid and layouts.verify_path(good).step == 2
    cases = {
        "no-meta": lambda d: os.remove(d / "meta.pt"),
        "torn-meta": lambda d: lb.truncate_half(d / "meta.pt"),
        "no-metadata": lambda d: os.remove(d / ".metadata"),
        "torn-shard": lambda d: lb.truncate_half(next(d.glob("*.distcp"))),
    }
    for i, (name, breaker) in enumerate(cases.items()):
        d = lb.fsdp_sharded_dir(tmp_path / f"{name}-step={10 + i}.ckpt", 10 + i)
        breaker(d)
        rec = layouts.verify_path(d)
        assert not rec.valid and rec.reason, (name, rec)
    assert layouts.latest_valid(tmp_path).step == 2


def test_deepspeed_directories(tmp_path: Path) -> None:
    """DeepSpeed: valid only with ``latest`` (written last) naming a tag whose files are intact and
    whose optimizer shards cover dp_world_size."""
    good = lb.deepspeed_dir(tmp_path / "epoch=0-step=2.ckpt", 2)
    assert layouts.verify_path(good).valid and layouts.verify_path(good).step == 2
    tag = "checkpoint"
    cases = {
        "no-latest": lambda d: os.remove(d / "latest"),
        "empty-latest": lambda d: (d / "latest").write_text(""),
        "torn-model": lambda d: lb.truncate_half(d / tag / "mp_rank_00_model_states.pt"),
        "missing-rank": lambda d: os.remove(d / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        "torn-optim": lambda d: lb.truncate_half(d / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    }
    for i, (name, breaker) in enumerate(cases.items()):
        d = lb.deepspeed_dir(tmp_path / f"{name}-step={10 + i}.ckpt", 10 + i)
        breaker(d)
        rec = layouts.verify_path(d)
        assert not rec.valid and rec.reason, (name, rec)
    assert layouts.latest_valid(tmp_path).step == 2

