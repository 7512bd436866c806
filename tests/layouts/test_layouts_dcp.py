"""torch DCP directories: complete, torn/missing .metadata, truncated or missing shards."""

from __future__ import annotations

import pickle
from pathlib import Path

from layout_builders import dcp_save, largest, truncate

from supervisor import layouts
from supervisor.layouts import dcp


def test_complete_dcp_is_valid(tmp_path: Path) -> None:
    d = dcp_save(tmp_path / "step_10")
    rec = layouts.verify_path(d)
    assert rec.valid, rec.reason
    assert rec.layout == "dcp" and rec.step == 10 and rec.size_bytes > 0


def test_missing_metadata_is_invalid(tmp_path: Path) -> None:
    d = dcp_save(tmp_path / "c")
    (d / ".metadata").unlink()
    rec = layouts.verify_path(d)
    assert not rec.valid and ".metadata missing" in rec.reason


def test_torn_metadata_is_invalid(tmp_path: Path) -> None:
    d = dcp_save(tmp_path / "c")
    truncate(d / ".metadata", 0.6)
    rec = layouts.verify_path(d)
    assert not rec.valid and "torn" in rec.reason


def test_empty_metadata_is_invalid(tmp_path: Path) -> None:
    d = dcp_save(tmp_path / "c")
    (d / ".metadata").write_bytes(b"")
    assert "empty" in layouts.verify_path(d).reason


def test_truncated_shard_is_caught_without_reading_it(tmp_path: Path) -> None:
    d = dcp_save(tmp_path / "c")
    shard = largest(d, "*.distcp")
    truncate(shard, 0.9)
    rec = layouts.verify_path(d)
    assert not rec.valid and "truncated" in rec.reason and shard.name in rec.reason


def test_missing_shard_is_invalid(tmp_path: Path) -> None:
    d = dcp_save(tmp_path / "c")
    largest(d, "*.distcp").unlink()
    assert "missing" in layouts.verify_path(d).reason


def test_hostile_metadata_is_not_unpickled(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    d = tmp_path / "c"
    d.mkdir()
    (d / ".metadata").write_bytes(pickle.dumps(Evil()))
    rec = layouts.verify_path(d)
    assert not rec.valid and "refusing to unpickle builtins.print" in rec.reason


def test_root_of_dcp_steps_picks_newest_valid(tmp_path: Path) -> None:
    for s in (100, 200, 300):
        dcp_save(tmp_path / f"step-{s}", seed=s)
    (tmp_path / "step-300" / ".metadata").unlink()  # killed mid-save
    assert layouts.detect_layout(tmp_path) == "dcp"
    assert [r.step for r in layouts.scan(tmp_path)] == [100, 200, 300]
    best = layouts.latest_valid(tmp_path)
    assert best is not None and best.step == 200


def test_extents_come_from_metadata(tmp_path: Path) -> None:
    d = dcp_save(tmp_path / "c")
    md, err = dcp.load_metadata(d)
    assert err is None
    need = dcp.storage_extents(md)
    assert need and all((d / rel).stat().st_size >= end for rel, end in need.items())


def test_extents_and_keys_are_what_torchs_own_reader_sees(tmp_path: Path) -> None:
    """rlsup reads .metadata with inert stubs (no torch): the same shards, ends and keys as DCP's own reader."""
    from torch.distributed.checkpoint import FileSystemReader

    d = dcp_save(tmp_path / "c")
    real = FileSystemReader(str(d)).read_metadata()
    want: dict[str, int] = {}
    for info in real.storage_data.values():
        want[info.relative_path] = max(want.get(info.relative_path, 0), info.offset + info.length)
    md, err = dcp.load_metadata(d)
    assert err is None and dcp.storage_extents(md) == want
    assert set(md.state_dict_metadata) == set(real.state_dict_metadata)


def test_an_enum_member_pickled_by_getattr_reads_and_nothing_else_does(tmp_path: Path) -> None:
    """Python 3.11.2 pickles an enum member as ``getattr(cls, name)`` (every tensor's memory format in a DCP
    .metadata); the real getattr would reach anything, so only a stubbed class's plain name reads."""
    d = tmp_path / "c"
    d.mkdir()
    member = b"cbuiltins\ngetattr\n(ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nVTORCH_CONTIGUOUS\ntR."
    (d / ".metadata").write_bytes(member)
    md, err = dcp.load_metadata(d)
    assert err is None and md.args == ("TORCH_CONTIGUOUS",), err
    for escape in (b"cbuiltins\ngetattr\n(ccollections\nOrderedDict\nV__init__\ntR.",
                   b"cbuiltins\ngetattr\n(ctorch.distributed.checkpoint.metadata\nMetadata\nV__class__\ntR."):
        (d / ".metadata").write_bytes(escape)
        md, err = dcp.load_metadata(d)
        assert md is None and "refusing getattr" in err, err


def test_a_bytearray_of_a_size_is_refused(tmp_path: Path) -> None:
    """A few bytes of pickle asking for ``bytearray(N)`` would allocate N bytes in rlsup."""
    d = tmp_path / "c"
    d.mkdir()
    (d / ".metadata").write_bytes(b"cbuiltins\nbytearray\n(I1000000000000\ntR.")
    md, err = dcp.load_metadata(d)
    assert md is None and "refusing bytearray(int)" in err, err
    (d / ".metadata").write_bytes(pickle.dumps(bytearray(b"ok"), protocol=4))  # bytearray(b"ok")
    assert dcp.load_metadata(d) == (bytearray(b"ok"), None)
