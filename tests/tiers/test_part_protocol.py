"""The part protocol (supervisor.tiers.part_protocol) in process, in seconds: an in-memory PartStore written
here and a local directory. Copy, fetch with holder fallback, corrupt sources, manifest last, a valid
destination kept, another rank's file never overwritten."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import BinaryIO, Iterator

import pytest

from rlsup_format.digest import FileEntry, copy_hashing
from rlsup_format.manifest import SCHEMA_VERSION, RankManifest, manifest_name, verify_step_dir
from rlsup_format.names import parse_manifest_rank, step_dir_name
from supervisor.tiers.part_protocol import (
    FetchFailed,
    PartConflict,
    PartError,
    PartInvalid,
    copy_part,
    fetch_part,
)
from supervisor.tiers.part_stores.local import LocalStore


def entry_of(data: bytes) -> FileEntry:
    return copy_hashing(io.BytesIO(data))


def manifest(step: int, rank: int, world: int, files: dict[str, bytes]) -> bytes:
    m = RankManifest(SCHEMA_VERSION, step, world, rank, "test", {n: entry_of(d) for n, d in files.items()}, 1.0)
    return m.to_json().encode()


class MemStep:
    """StepReader over one step of a MemStore."""

    def __init__(self, files: dict[str, bytes] | None) -> None:
        self.files = files

    def names(self) -> list[str]:
        if self.files is None:
            raise FileNotFoundError("no such step")
        return sorted({n.split("/", 1)[0] for n in self.files})

    def read(self, name: str) -> bytes:
        if self.files is None or name not in self.files:
            raise FileNotFoundError(name)
        return self.files[name]

    def check(self, name: str, entry: FileEntry, full: bool) -> str:
        if self.files is None or name not in self.files:
            return f"{name}: missing"
        data = self.files[name]
        if len(data) != entry.size:
            return f"{name}: size {len(data)} != {entry.size}"
        return "" if not full or entry_of(data) == entry else f"checksum mismatch in {name}"


class MemStore:
    """A dict-backed PartStore: {step: {name: bytes}}. ``fail_after``: data puts allowed before an OSError.
    ``log``: every write, in order."""

    def __init__(self, location: str = "mem") -> None:
        self.location = location
        self.data: dict[int, dict[str, bytes]] = {}
        self.log: list[str] = []
        self.fail_after: int | None = None

    def steps(self) -> list[int]:
        return sorted(self.data)

    def reader(self, step: int) -> MemStep:
        return MemStep(self.data.get(step))

    def open(self, step: int, name: str) -> BinaryIO:
        try:
            return io.BytesIO(self.data[step][name])
        except KeyError:
            raise FileNotFoundError(name) from None

    def put_file(self, step: int, name: str, src: BinaryIO, entry: FileEntry) -> None:
        if self.fail_after is not None:
            if self.fail_after == 0:
                raise OSError("disk full")
            self.fail_after -= 1
        out = io.BytesIO()
        if copy_hashing(src, out) != entry:
            raise PartInvalid(f"{name} does not match")
        self.data.setdefault(step, {})[name] = out.getvalue()
        self.log.append(name)

    def put_manifest(self, step: int, rank: int, raw: bytes) -> None:
        self.data.setdefault(step, {})[manifest_name(rank)] = raw
        self.log.append(manifest_name(rank))

    def remove_manifest(self, step: int, rank: int) -> None:
        self.data.get(step, {}).pop(manifest_name(rank), None)
        self.log.append(f"-{manifest_name(rank)}")

    def delete(self, step: int) -> None:
        self.data.pop(step, None)

    def clean(self) -> None:
        pass

    @contextlib.contextmanager
    def hold(self, step: int) -> Iterator[None]:
        if step not in self.data:
            raise PartInvalid(f"step {step} is gone")
        yield

    def add_part(self, step: int, rank: int, world: int, files: dict[str, bytes]) -> None:
        self.data.setdefault(step, {}).update(files)
        self.data[step][manifest_name(rank)] = manifest(step, rank, world, files)

    def manifests(self, step: int) -> list[int]:
        return sorted(r for n in self.data.get(step, {}) if (r := parse_manifest_rank(n)) is not None)


FILES0 = {"rank_00000.pt": b"zero" * 1000, "shared/meta.json": b'{"a": 1}'}
FILES1 = {"rank_00001.pt": b"one" * 1000, "shared/meta.json": b'{"a": 1}'}


def flip(store: MemStore, step: int, name: str) -> None:
    data = bytearray(store.data[step][name])
    data[len(data) // 2] ^= 0xFF
    store.data[step][name] = bytes(data)


def test_copy_writes_data_first_and_the_manifest_last() -> None:
    src, dst = MemStore("src"), MemStore("dst")
    src.add_part(10, 0, 2, FILES0)
    done = copy_part(src, dst, 10, 0)
    assert done.written and done.size == sum(len(d) for d in FILES0.values())
    # the data files (copied in parallel, so in any order), then the commit, last
    assert sorted(dst.log[:-1]) == sorted(FILES0) and dst.log[-1] == manifest_name(0)
    assert dst.data[10] == src.data[10]


def test_a_valid_identical_part_is_kept_as_is() -> None:
    src, dst = MemStore("src"), MemStore("dst")
    src.add_part(10, 0, 1, FILES0)
    copy_part(src, dst, 10, 0)
    dst.log.clear()
    assert not copy_part(src, dst, 10, 0).written and dst.log == []


def test_a_valid_different_part_is_kept_unless_mirroring() -> None:
    """A valid copy is never rewritten (a failed rewrite would turn it invalid); a replica mirrors its owner."""
    src, dst = MemStore("src"), MemStore("dst")
    src.add_part(10, 0, 1, {"rank_00000.pt": b"new" * 100})
    dst.add_part(10, 0, 1, {"rank_00000.pt": b"old" * 100})
    kept = dict(dst.data[10])
    done = copy_part(src, dst, 10, 0)
    assert not done.written and dst.data[10] == kept and done.manifest.files["rank_00000.pt"] == entry_of(b"old" * 100)
    assert copy_part(src, dst, 10, 0, keep_valid=False).written and dst.data[10] == src.data[10]


def test_a_corrupt_source_is_never_copied() -> None:
    src, dst = MemStore("src"), MemStore("dst")
    src.add_part(10, 0, 1, FILES0)
    flip(src, 10, "rank_00000.pt")
    with pytest.raises(PartInvalid, match="checksum"):
        copy_part(src, dst, 10, 0)
    assert dst.data == {}  # verified before anything was written
    # Not hashed beforehand (a fetch): the bytes are checked as they pass, the manifest never written.
    with pytest.raises(PartInvalid):
        copy_part(src, dst, 10, 0, full=False)
    assert manifest_name(0) not in dst.data.get(10, {}) and "rank_00000.pt" not in dst.data.get(10, {})
    src.data[10][manifest_name(0)] = b"{torn"
    with pytest.raises(PartInvalid, match="torn"):
        copy_part(src, dst, 10, 0)


def test_a_store_failing_mid_copy_leaves_no_manifest() -> None:
    src, dst = MemStore("src"), MemStore("dst")
    src.add_part(10, 0, 1, FILES0)
    dst.fail_after = 1
    with pytest.raises(OSError, match="disk full"):
        copy_part(src, dst, 10, 0)
    assert dst.manifests(10) == []  # one data file landed, the part is not valid
    dst.fail_after = None
    assert copy_part(src, dst, 10, 0).written and dst.manifests(10) == [0]
    assert dst.log.count("rank_00000.pt") + dst.log.count("shared/meta.json") == 2  # nothing written twice


def test_an_invalid_old_part_loses_its_manifest_first() -> None:
    src, dst = MemStore("src"), MemStore("dst")
    src.add_part(10, 0, 1, FILES0)
    copy_part(src, dst, 10, 0)
    flip(dst, 10, "rank_00000.pt")
    dst.log.clear()
    assert copy_part(src, dst, 10, 0).written
    assert dst.log == [f"-{manifest_name(0)}", "rank_00000.pt", manifest_name(0)]
    assert dst.data[10] == src.data[10]


def test_another_ranks_file_is_never_overwritten() -> None:
    src, dst = MemStore("src"), MemStore("dst")
    dst.add_part(10, 1, 2, FILES1)
    src.add_part(10, 0, 2, {**FILES0, "shared/meta.json": b'{"a": 2}'})  # same name, other contents
    with pytest.raises(PartConflict, match="manifest.rank_00001.json"):
        copy_part(src, dst, 10, 0)
    assert dst.data[10]["shared/meta.json"] == FILES1["shared/meta.json"] and dst.manifests(10) == [1]


def test_fetch_falls_back_to_the_next_holder() -> None:
    missing, corrupt, good, dst = MemStore("missing"), MemStore("corrupt"), MemStore("good"), MemStore("dst")
    for s in (corrupt, good):
        s.add_part(10, 0, 1, FILES0)
    flip(corrupt, 10, "rank_00000.pt")
    used, done = fetch_part([missing, corrupt, good], dst, 10, 0)
    assert used is good and done.written and dst.data[10] == good.data[10]


def test_fetch_reports_invalid_holders_apart_from_io_problems() -> None:
    class Down(MemStore):
        def reader(self, step: int) -> MemStep:
            raise ConnectionError("peer down")

    corrupt, down, dst = MemStore("corrupt"), Down("down"), MemStore("dst")
    for s in (corrupt, down):
        s.add_part(10, 0, 1, FILES0)
    flip(corrupt, 10, "rank_00000.pt")
    with pytest.raises(FetchFailed) as e:
        fetch_part([down, corrupt], dst, 10, 0)
    assert e.value.invalid == [corrupt]  # the down one says nothing about its copy
    assert "down: peer down" in str(e.value) and "corrupt: invalid" in str(e.value)
    assert isinstance(e.value, PartError) and dst.manifests(10) == []
    with pytest.raises(FetchFailed) as e:
        fetch_part([MemStore("empty")], dst, 10, 0, accept=lambda m: "")
    assert [h.location for h in e.value.invalid] == ["empty"]  # no such part: invalid, not an I/O problem


def test_accept_refuses_another_jobs_part() -> None:
    src, dst = MemStore("src"), MemStore("dst")
    src.add_part(10, 0, 1, FILES0)
    with pytest.raises(PartInvalid, match="other job"):
        copy_part(src, dst, 10, 0, accept=lambda m: "other job")
    assert dst.data == {}


def test_local_directory_both_ways(tmp_path: Path) -> None:
    """Memory -> directory -> memory; the directory's step verifies with the manifest rules, no temp
    name is left, and a corrupt file in the directory is caught on the way out."""
    mem = MemStore("mem")
    mem.add_part(10, 0, 2, FILES0)
    mem.add_part(10, 1, 2, FILES1)
    local = LocalStore(tmp_path / "ckpt")
    for rank in (0, 1):
        assert copy_part(mem, local, 10, rank).written
    step_dir = tmp_path / "ckpt" / step_dir_name(10)
    assert verify_step_dir(step_dir).valid
    assert sorted(p.name for p in step_dir.iterdir()) == sorted(
        {"rank_00000.pt", "rank_00001.pt", "shared", manifest_name(0), manifest_name(1)})
    assert not any(p.name.startswith(".") for p in step_dir.rglob("*"))  # holds and temp files gone
    back = MemStore("back")
    used, _ = fetch_part([local], back, 10, 1)
    assert used is local and back.data[10] == {**FILES1, manifest_name(1): mem.data[10][manifest_name(1)]}
    (step_dir / "rank_00001.pt").write_bytes(b"x" * len(FILES1["rank_00001.pt"]))  # same size, other bytes
    with pytest.raises(FetchFailed) as e:
        fetch_part([local], MemStore("again"), 10, 1)
    assert e.value.invalid == [local]
    # Into a directory, a mismatching file never gets its final name.
    bad = MemStore("bad")
    bad.add_part(20, 0, 1, FILES0)
    flip(bad, 20, "rank_00000.pt")
    with pytest.raises(PartInvalid):
        copy_part(bad, local, 20, 0, full=False)
    assert not (tmp_path / "ckpt" / step_dir_name(20) / "rank_00000.pt").exists()
    assert json.loads(mem.data[10][manifest_name(0)])["rank"] == 0


def test_a_parts_files_are_copied_concurrently(tmp_path: Path) -> None:
    """Four files of one part: copies run side by side (a fetch from a peer, a drain to disk, a copy
    to the persistent tier), each still checked as its bytes pass, the manifest still last."""
    import threading

    files = {f"__{i}_0.distcp": bytes([i]) * 50_000 for i in range(4)}
    src = MemStore("src")
    src.add_part(3, 0, 1, files)
    meet = threading.Barrier(2, timeout=10)  # one copy after another would never meet here

    class Meeting(LocalStore):
        def put_file(self, step: int, name: str, f: BinaryIO, entry: FileEntry) -> None:
            meet.wait()
            super().put_file(step, name, f, entry)

    assert copy_part(src, Meeting(tmp_path / "ckpt"), 3, 0).written
    assert verify_step_dir(tmp_path / "ckpt" / step_dir_name(3), full=True).valid
