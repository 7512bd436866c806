"""ReplicaStore: strict names, symlink-proof paths, verify-then-rename writes, index cache, delete."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import xxhash

from supervisor.transport.store import (IntegrityError, InvalidPath, NotFound, ReplicaStore, validate_namespace,
                                        validate_relpath)
from rlsup_format.manifest import FileEntry


def entry_of(data: bytes) -> FileEntry:
    return FileEntry(len(data), xxhash.xxh3_128_hexdigest(data))


def put(store: ReplicaStore, ns: str, rel: str, data: bytes) -> FileEntry:
    inc = store.begin_write(ns, rel, len(data), xxhash.xxh3_128_hexdigest(data))
    inc.write(data)
    return inc.commit()


@pytest.mark.parametrize("rel", [
    "..", "../x", "a/../b", "a/./b", ".", "/etc/passwd", "a//b", "a/", "", "a\\b", "a\x00b", "a b", "a/%2e%2e",
    "é", "x" * 256, "/".join(["a"] * 33), "a/" * 600 + "b",
])
def test_bad_relpaths_refused(rel: str) -> None:
    with pytest.raises(InvalidPath):
        validate_relpath(rel)


@pytest.mark.parametrize("rel", [
    ".metadata", "step_000000100/__0_0.distcp", "iter_0000100/mp_rank_00/model_optim_rng.pt",
    "global_step_5/actor/huggingface/tokenizer.json", "a/.hidden/b", "model-00001-of-00004.safetensors",
    "x+y=z@1,2~3",
])
def test_checkpoint_names_allowed(rel: str) -> None:
    assert "/".join(validate_relpath(rel)) == rel


@pytest.mark.parametrize("ns", [".incoming", ".meta", "..", "", "a/b", "-x", "n" * 129, "a b"])
def test_bad_namespaces_refused(ns: str) -> None:
    with pytest.raises(InvalidPath):
        validate_namespace(ns)


def test_put_index_read_delete(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path / "s")
    a = put(store, "node0", "step_000000001/.metadata", b"meta")
    b = put(store, "node0", "step_000000001/__0_0.distcp", os.urandom(100_000))
    put(store, "node0", "step_000000010/x", b"ten")
    put(store, "node1", "step_000000001/x", b"other ns")
    idx = store.index("node0")
    assert idx == {"step_000000001/.metadata": a, "step_000000001/__0_0.distcp": b,
                   "step_000000010/x": entry_of(b"ten")}
    assert store.path_of("node0", "step_000000001/.metadata").read_bytes() == b"meta"
    assert store.index("empty") == {}
    # Whole segments only: deleting step_000000001 keeps step_000000010.
    assert store.delete("node0", "step_000000001") == 2
    assert set(store.index("node0")) == {"step_000000010/x"}
    assert store.delete("node0", "step_000000001") == 0
    assert store.delete("node0", "") == 1
    assert store.index("node0") == {} and set(store.index("node1")) == {"step_000000001/x"}
    with pytest.raises(NotFound):
        store.open_read("node0", "step_000000010/x")
    assert os.listdir(tmp_path / "s" / ".incoming") == []


def test_failed_write_keeps_existing_and_leaves_nothing(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path / "s")
    put(store, "n", "f", b"original")
    # Wrong checksum.
    inc = store.begin_write("n", "f", 5, "0" * 32)
    inc.write(b"hello")
    with pytest.raises(IntegrityError, match="mismatch"):
        inc.commit()
    # Short body.
    inc = store.begin_write("n", "f", 10, xxhash.xxh3_128_hexdigest(b"0123456789"))
    inc.write(b"01234")
    with pytest.raises(IntegrityError, match="5 bytes, 10 declared"):
        inc.commit()
    # Too long.
    inc = store.begin_write("n", "f", 2, xxhash.xxh3_128_hexdigest(b"ab"))
    with pytest.raises(IntegrityError):
        inc.write(b"abc")
    inc.abort()
    assert store.path_of("n", "f").read_bytes() == b"original"
    assert os.listdir(tmp_path / "s" / ".incoming") == []


def test_symlinks_inside_store_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"keep me")
    root = tmp_path / "s"
    store = ReplicaStore(root)
    put(store, "n", "ok", b"x")
    os.symlink(outside, root / "n" / "step_1")          # a directory symlink inside the namespace
    os.symlink(outside / "victim", root / "n" / "file")  # a file symlink
    os.symlink(outside, root / "evil")                   # a namespace that is a symlink
    data = b"attack"
    for ns, rel in [("n", "step_1/new"), ("n", "step_1/victim"), ("evil", "new"), ("n", "file")]:
        with pytest.raises(InvalidPath):
            put(store, ns, rel, data)
        with pytest.raises((InvalidPath, NotFound)):
            store.open_read(ns, rel)
        with pytest.raises(InvalidPath):
            store.path_of(ns, rel)
    assert sorted(os.listdir(outside)) == ["victim"] and (outside / "victim").read_bytes() == b"keep me"
    assert set(store.index("n")) == {"ok"}  # symlinks are never listed
    with pytest.raises(InvalidPath):
        store.index("evil")
    # Deleting a symlink removes the link, never what it points to.
    store.delete("n", "step_1")
    store.delete("n", "file")
    assert (outside / "victim").read_bytes() == b"keep me"
    assert not (root / "n" / "step_1").exists() and not os.path.lexists(root / "n" / "file")


def test_index_cache_persists_and_detects_changes(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = ReplicaStore(root)
    e = put(store, "n", "a/b", b"one")
    store.close()
    assert (root / ".meta" / "n.json").exists()
    store2 = ReplicaStore(root)
    assert store2.index("n") == {"a/b": e}
    # Changed behind the store's back (same size): re-hashed, not served from the sidecar.
    p = root / "n" / "a" / "b"
    p.write_bytes(b"two")
    os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 1_000_000))
    assert store2.index("n") == {"a/b": entry_of(b"two")}
    # Files placed by hand are indexed too.
    (root / "n" / "c").write_bytes(b"hand")
    assert store2.index("n")["c"] == entry_of(b"hand")


def test_put_file_and_replace(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path / "s")
    src = tmp_path / "src"
    src.write_bytes(b"v1")
    store.put_file("n", "x/y", src, entry_of(b"v1"))
    src.write_bytes(b"v2!")
    store.put_file("n", "x/y", src, entry_of(b"v2!"))
    assert store.path_of("n", "x/y").read_bytes() == b"v2!"
    assert store.index("n") == {"x/y": entry_of(b"v2!")}


def test_incoming_leftovers_cleaned_on_open(tmp_path: Path) -> None:
    root = tmp_path / "s"
    ReplicaStore(root).close()
    (root / ".incoming" / "leftover").write_bytes(b"partial")
    ReplicaStore(root).close()
    assert os.listdir(root / ".incoming") == []
