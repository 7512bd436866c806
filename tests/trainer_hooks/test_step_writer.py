"""trainer_hooks.step_writer on plain data, in process: the one protocol that writes a rank's part.

Real files under tmp_path, one rank alone (no process group), the torch backend or small test
backends that look at the step directory while the protocol runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from rlsup_format.manifest import list_step_dirs, read_manifest, verify_step_dir
from rlsup_format.names import Kind, parse_reserved, reserved_name, staging_label, step_dir_name
from trainer_hooks.backends.base import SaveContext, safe_load
from trainer_hooks.backends.torch_backend import TorchBackend, shard_name
from trainer_hooks.step_writer import (
    CheckpointConflictError,
    RankIdentity,
    StepTarget,
    build_payload,
    wait_for_removals,
    write_step,
)


def _who(job: str | None = "job-a", rank: int = 0, world: int = 1) -> RankIdentity:
    return RankIdentity(rank=rank, world_size=world, node_rank=0, job=job)


def _payload(value: float = 1.0) -> dict[str, Any]:
    return {"model": {"w": torch.full((64,), value)}, "step_count": int(value)}


class SpyBackend(TorchBackend):
    """The torch backend, recording what the step directory looked like while it wrote."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.seen: list[dict[str, Any]] = []

    def save(self, ctx: SaveContext, payload: dict[str, Any]) -> None:
        self.seen.append({"staging": ctx.staging, "entries": sorted(os.listdir(ctx.step_dir))})
        super().save(ctx, payload)
        (ctx.staging / "sub").mkdir()
        (ctx.staging / "sub" / "extra.bin").write_bytes(b"x" * 1000)
        if self.fail:
            raise RuntimeError("backend died mid-save")


# ------------------------------------------------------------------------------ a step verifies


def test_torch_step_verifies_and_loads_back(tmp_path: Path) -> None:
    payload = build_payload(_payload(3.0))
    step_dir = write_step(StepTarget(tmp_path), 7, payload, _who(), TorchBackend())
    assert step_dir == tmp_path / step_dir_name(7)
    result = verify_step_dir(step_dir, full=True)
    assert result.valid, result.reason
    assert (result.step, result.world_size) == (7, 1)
    m = read_manifest(step_dir / "manifest.rank_00000.json")
    assert m.backend == "torch" and list(m.files) == [shard_name(0)]
    assert m.extra["job"] == "job-a" and m.extra["node_rank"] == 0 and m.extra["pid"] == os.getpid()
    loaded = safe_load(step_dir / shard_name(0))
    assert torch.equal(loaded["model"]["w"], torch.full((64,), 3.0)) and loaded["step_count"] == 3
    # nothing reserved is left: no staging dir, no temp manifest
    assert [n for n in os.listdir(step_dir) if n.startswith(".")] == []


def test_payload_callable_is_called_only_when_writing(tmp_path: Path) -> None:
    calls = []

    def make() -> dict[str, Any]:
        calls.append(1)
        return _payload()

    target = StepTarget(tmp_path)
    write_step(target, 1, make, _who(), TorchBackend())
    write_step(target, 1, make, _who(), TorchBackend())  # already valid: never built again
    assert calls == [1]


# ------------------------------------------------------------------------ the manifest is last


def test_backend_writes_into_a_fresh_staging_dir_before_any_manifest(tmp_path: Path) -> None:
    backend = SpyBackend()
    step_dir = write_step(StepTarget(tmp_path), 1, _payload(), _who(), backend)
    (seen,) = backend.seen
    res = parse_reserved(seen["staging"].name)
    assert res is not None and res.kind is Kind.STAGING and res.label == staging_label(0) and res.mine()
    assert seen["staging"].parent == step_dir
    assert seen["entries"] == [seen["staging"].name]  # no manifest, no data file under a final name yet
    assert not seen["staging"].exists()
    m = read_manifest(step_dir / "manifest.rank_00000.json")
    assert set(m.files) == {shard_name(0), "sub/extra.bin"}
    assert verify_step_dir(step_dir).valid


def test_backend_failure_leaves_no_manifest_and_no_staging(tmp_path: Path) -> None:
    target = StepTarget(tmp_path)
    with pytest.raises(RuntimeError, match="mid-save"):
        write_step(target, 1, _payload(), _who(), SpyBackend(fail=True))
    step_dir = tmp_path / step_dir_name(1)
    assert sorted(os.listdir(step_dir)) == []  # staging removed; no file got its final name
    assert not verify_step_dir(step_dir).valid
    # the next save of the same step completes it
    write_step(target, 1, _payload(), _who(), TorchBackend())
    assert verify_step_dir(step_dir).valid


def test_rewriting_an_invalid_own_part_removes_its_manifest_first(tmp_path: Path) -> None:
    target = StepTarget(tmp_path)
    step_dir = write_step(target, 1, _payload(1.0), _who(), TorchBackend())
    shard = step_dir / shard_name(0)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))  # same size, other bytes: invalid in full
    assert not verify_step_dir(step_dir, full=True).valid
    backend = SpyBackend(fail=True)
    with pytest.raises(RuntimeError):
        write_step(target, 1, _payload(2.0), _who(), backend)
    # the old manifest went before the backend wrote anything: the torn part can never look valid
    assert "manifest.rank_00000.json" not in backend.seen[0]["entries"]
    assert not (step_dir / "manifest.rank_00000.json").exists()
    assert not verify_step_dir(step_dir, full=False).valid
    write_step(target, 1, _payload(2.0), _who(), TorchBackend())
    assert verify_step_dir(step_dir, full=True).valid
    assert torch.equal(safe_load(shard)["model"]["w"], torch.full((64,), 2.0))


# ----------------------------------------------------------------- a valid part is not rewritten


def test_valid_own_part_is_not_rewritten(tmp_path: Path) -> None:
    target = StepTarget(tmp_path)
    step_dir = write_step(target, 5, _payload(1.0), _who(), TorchBackend())
    paths = [step_dir / shard_name(0), step_dir / "manifest.rank_00000.json"]
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}
    backend = SpyBackend()
    write_step(target, 5, _payload(9.0), _who(), backend)
    assert backend.seen == []  # the backend was never asked
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths} == before
    assert torch.equal(safe_load(paths[0])["model"]["w"], torch.full((64,), 1.0))


def test_part_of_another_world_size_is_rewritten_when_the_step_is_not_complete(tmp_path: Path) -> None:
    """A leftover rank-0 part of a 2-rank run (rank 1 never finished) is no valid part for a 1-rank job."""
    target = StepTarget(tmp_path)
    step_dir = write_step(target, 3, _payload(1.0), _who(world=2), TorchBackend())
    assert not verify_step_dir(step_dir).valid  # rank 1's manifest is missing
    write_step(target, 3, _payload(4.0), _who(world=1), TorchBackend())
    assert verify_step_dir(step_dir).valid
    assert read_manifest(step_dir / "manifest.rank_00000.json").world_size == 1


def test_a_torch_save_is_hashed_as_written_and_never_read_back(tmp_path: Path, monkeypatch) -> None:
    """The shard goes through a write-through hashing file: publishing it reads no byte back, and the
    manifest's checksum is the one of the bytes on disk. A file a library writes by path (here
    ``sub/extra.bin``, written beside the shard) is still hashed after the fact."""
    import trainer_hooks.step_writer as sw
    from rlsup_format.digest import hash_file

    reread: list[str] = []
    real = sw.hash_own_file
    monkeypatch.setattr(sw, "hash_own_file", lambda p: reread.append(Path(p).name) or real(p))
    step_dir = write_step(StepTarget(tmp_path), 1, _payload(2.0), _who(), SpyBackend())
    assert reread == ["extra.bin"]  # the shard was never read back
    m = read_manifest(step_dir / "manifest.rank_00000.json")
    assert m.files[shard_name(0)] == hash_file(step_dir / shard_name(0))
    assert verify_step_dir(step_dir, full=True).valid
    assert safe_load(step_dir / shard_name(0))["model"]["w"][0].item() == 2.0


def test_hashing_writer_refuses_an_existing_file_and_hashes_every_byte(tmp_path: Path) -> None:
    from rlsup_format.digest import HashingWriter, hash_file

    path = tmp_path / "f.bin"
    with HashingWriter(path) as w:
        w.write(b"abc")
        w.write(memoryview(torch.arange(1000, dtype=torch.int64).numpy()))  # a multi-byte view
    assert w.entry == hash_file(path) and w.entry.size == 3 + 8000
    with pytest.raises(FileExistsError):
        HashingWriter(path)


# -------------------------------------------------------------------------------- retention


def _steps(directory: Path) -> list[int]:
    return [s for s, _ in list_step_dirs(directory)]


def test_retention_keeps_keep_last_valid_steps(tmp_path: Path) -> None:
    target = StepTarget(tmp_path, keep_last=2)
    for step in range(1, 6):
        write_step(target, step, _payload(step), _who(), TorchBackend())
    assert _steps(tmp_path) == [4, 5]
    assert all(verify_step_dir(p).valid for _, p in list_step_dirs(tmp_path))
    # nothing of the deletions is left once the background removals are done (a reserved 'deleting' name meanwhile)
    wait_for_removals()
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


def test_retention_never_deletes_the_resume_step_or_a_held_step(tmp_path: Path) -> None:
    plain = StepTarget(tmp_path)
    for step in (1, 2, 3):
        write_step(plain, step, _payload(step), _who(), TorchBackend())
    hold = tmp_path / step_dir_name(2) / reserved_name(Kind.HOLD, "test")
    hold.touch()
    target = StepTarget(tmp_path, keep_last=1, resume_dir=str(tmp_path / step_dir_name(1)))
    for step in (4, 5):
        write_step(target, step, _payload(step), _who(), TorchBackend())
    assert _steps(tmp_path) == [1, 2, 5]
    hold.unlink()
    write_step(target, 6, _payload(6), _who(), TorchBackend())
    assert _steps(tmp_path) == [1, 6]  # the hold is gone; the resume step stays


def test_retention_keeps_an_invalid_newer_step_and_waits_for_an_incomplete_new_one(tmp_path: Path) -> None:
    target = StepTarget(tmp_path, keep_last=1)
    write_step(target, 1, _payload(1), _who(), TorchBackend())
    (tmp_path / step_dir_name(9)).mkdir()  # another save may still be writing it
    write_step(target, 2, _payload(2), _who(), TorchBackend())
    assert _steps(tmp_path) == [2, 9]
    # rank 0 of a 2-rank step: not complete, so retention does not run at all
    write_step(target, 3, _payload(3), _who(world=2), TorchBackend())
    assert _steps(tmp_path) == [2, 3, 9]


# ------------------------------------------------------------------------------ another job


def test_valid_step_of_another_job_is_refused_not_overwritten(tmp_path: Path) -> None:
    step_dir = write_step(StepTarget(tmp_path), 4, _payload(1.0), _who(job="job-a"), TorchBackend())
    shard = step_dir / shard_name(0)
    before = (shard.stat().st_ino, shard.stat().st_mtime_ns)
    with pytest.raises(CheckpointConflictError, match="job-a"):
        write_step(StepTarget(tmp_path), 4, _payload(2.0), _who(job="job-b"), TorchBackend())
    assert (shard.stat().st_ino, shard.stat().st_mtime_ns) == before
    assert verify_step_dir(step_dir).valid
    assert read_manifest(step_dir / "manifest.rank_00000.json").extra["job"] == "job-a"
    # same job, or a job without an identity: "already valid", no error
    write_step(StepTarget(tmp_path), 4, _payload(3.0), _who(job="job-a"), TorchBackend())
    write_step(StepTarget(tmp_path), 4, _payload(3.0), _who(job=None), TorchBackend())
    assert (shard.stat().st_ino, shard.stat().st_mtime_ns) == before


def test_own_part_of_another_job_in_an_incomplete_step_is_refused(tmp_path: Path) -> None:
    """Rank 0's part of a 2-rank step written by job-a: job-b's rank 0 must neither take it as its own
    save nor overwrite it."""
    step_dir = write_step(StepTarget(tmp_path), 6, _payload(1.0), _who(job="job-a", world=2), TorchBackend())
    shard = step_dir / shard_name(0)
    before = (shard.stat().st_ino, shard.stat().st_mtime_ns)
    with pytest.raises(CheckpointConflictError, match="job-a"):
        write_step(StepTarget(tmp_path), 6, _payload(2.0), _who(job="job-b", world=2), TorchBackend())
    assert (shard.stat().st_ino, shard.stat().st_mtime_ns) == before


# ------------------------------------------------------------------------- killed saves' leftovers


