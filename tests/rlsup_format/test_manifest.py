"""Manifest format and verification: every kind of damage makes a step invalid, never an exception."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlsup_format.manifest import (
    SCHEMA_VERSION,
    STEP_DIR_RE,
    FileEntry,
    ManifestError,
    RankManifest,
    hash_file,
    is_held,
    latest_valid,
    list_step_dirs,
    manifest_name,
    step_dir_name,
    verify_step_dir,
    write_manifest,
)


def make_step(root: Path, step: int, world: int = 2, payload: bytes = b"x" * 20) -> Path:
    """A real step directory as ranks would write it: one data file and one manifest per rank."""
    d = root / step_dir_name(step)
    d.mkdir(parents=True)
    for rank in range(world):
        name = f"rank_{rank:05d}.pt"
        (d / name).write_bytes(payload + bytes([rank]) * 3)
        m = RankManifest(SCHEMA_VERSION, step, world, rank, "torch", {name: hash_file(d / name)}, 1.0, "t", {})
        write_manifest(d, m)
    return d


def test_names_and_regex():
    assert step_dir_name(42) == "step_000000042"
    assert STEP_DIR_RE.match(step_dir_name(42))
    assert not STEP_DIR_RE.match(".staging-step_000000042")
    assert manifest_name(3) == "manifest.rank_00003.json"


def test_hash_file_matches_xxhash(tmp_path: Path):
    import xxhash

    data = os.urandom(9 * 1024 * 1024 + 7)  # crosses the 8 MiB chunk boundary
    (tmp_path / "f").write_bytes(data)
    assert hash_file(tmp_path / "f") == FileEntry(len(data), xxhash.xxh3_128(data).hexdigest())


def test_manifest_round_trip():
    m = RankManifest(SCHEMA_VERSION, 7, 2, 1, "dcp", {"dcp/__1_0.distcp": FileEntry(5, "0" * 32)}, 2.5, "0.1.0",
                     {"pid": 3})
    assert RankManifest.from_json(m.to_json()) == m


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(step="7"), "'step' must be an integer"),
    (lambda d: d.update(step=True), "'step' must be an integer"),
    (lambda d: d.update(schema=99), "unsupported schema 99"),
    (lambda d: d.update(rank=2), "out of range"),
    (lambda d: d.pop("files"), "missing field(s): files"),
    (lambda d: d.update(surprise=1), "unknown field(s): surprise"),
    (lambda d: d.update(files={"../escape": {"size": 1, "xxh3_128": "0" * 32}}), "'..'"),
    (lambda d: d.update(files={"/etc/passwd": {"size": 1, "xxh3_128": "0" * 32}}), "absolute"),
    (lambda d: d.update(files={"C:evil": {"size": 1, "xxh3_128": "0" * 32}}), "absolute"),
    (lambda d: d.update(files={"a\\..\\b": {"size": 1, "xxh3_128": "0" * 32}}), "backslash"),
    (lambda d: d.update(files={"a//b": {"size": 1, "xxh3_128": "0" * 32}}), "empty"),
    (lambda d: d.update(files={"a": {"size": -1, "xxh3_128": "0" * 32}}), "non-negative"),
    (lambda d: d.update(files={"a": {"size": 1, "xxh3_128": "XYZ"}}), "hex"),
])
def test_from_json_is_strict(mutate, message):
    data = json.loads(RankManifest(SCHEMA_VERSION, 7, 2, 1, "torch", {}, 1.0, "v", {}).to_json())
    mutate(data)
    with pytest.raises(ManifestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RankManifest.from_json(json.dumps(data))


def test_from_json_rejects_garbage():
    for text in ["", "{", "[]", "null", b"\xff\xfe"]:
        with pytest.raises(ManifestError):
            RankManifest.from_json(text)


def test_valid_step(tmp_path: Path):
    d = make_step(tmp_path, 5)
    r = verify_step_dir(d)
    assert (r.valid, r.reason, r.step, r.world_size) == (True, "ok", 5, 2)
    assert r.size_bytes > 2 * 23
    assert not any(p.name.startswith(".manifest") for p in d.iterdir())  # no temp left by write_manifest


def test_flipped_byte_only_caught_by_full(tmp_path: Path):
    d = make_step(tmp_path, 5)
    f = d / "rank_00001.pt"
    data = bytearray(f.read_bytes())
    data[3] ^= 0x01
    f.write_bytes(bytes(data))
    assert verify_step_dir(d, full=False).valid
    r = verify_step_dir(d)
    assert not r.valid and r.reason == "checksum mismatch in rank_00001.pt"


def test_truncated_shard(tmp_path: Path):
    d = make_step(tmp_path, 5)
    with open(d / "rank_00001.pt", "r+b") as f:
        f.truncate(10)
    r = verify_step_dir(d, full=False)
    assert not r.valid and r.reason == "rank_00001.pt: size 10 != 23"


def test_missing_rank_manifest(tmp_path: Path):
    d = make_step(tmp_path, 5)
    (d / manifest_name(1)).unlink()
    r = verify_step_dir(d)
    assert not r.valid and r.reason == "rank 1 manifest missing"


def test_torn_manifest(tmp_path: Path):
    d = make_step(tmp_path, 5)
    p = d / manifest_name(0)
    p.write_bytes(p.read_bytes()[:40])
    r = verify_step_dir(d)
    assert not r.valid and r.reason.startswith("torn manifest: manifest.rank_00000.json")


def test_missing_file_and_disagreement(tmp_path: Path):
    d = make_step(tmp_path, 5)
    (d / "rank_00000.pt").unlink()
    assert verify_step_dir(d).reason == "rank_00000.pt: missing"
    d2 = make_step(tmp_path, 6)
    m = RankManifest.from_json((d2 / manifest_name(1)).read_text())
    m.world_size = 3
    write_manifest(d2, m)
    assert "world_size" in verify_step_dir(d2).reason
    d3 = make_step(tmp_path, 8)
    (d3.parent / "step_000000009").mkdir()
    for f in d3.iterdir():
        f.rename(d3.parent / "step_000000009" / f.name)
    assert verify_step_dir(d3.parent / "step_000000009").reason == "manifest step 8 != directory step 9"


def test_never_raises(tmp_path: Path):
    assert verify_step_dir(tmp_path / "step_000000001").reason == "directory missing"
    (tmp_path / "step_000000002").mkdir()
    assert verify_step_dir(tmp_path / "step_000000002").reason == "no manifests"
    assert not verify_step_dir(tmp_path / "junk").valid


def test_latest_valid_skips_each_kind_of_damage(tmp_path: Path):
    make_step(tmp_path, 100)
    damaged = {
        200: lambda d: (d / "rank_00001.pt").write_bytes(b"y" * 23),            # flipped bytes
        300: lambda d: os.truncate(d / "rank_00000.pt", 5),                      # truncated shard
        400: lambda d: (d / manifest_name(1)).unlink(),                          # rank died before manifest
        500: lambda d: (d / manifest_name(0)).write_text('{"schema": 1, "st'),   # torn manifest
    }
    for step, damage in damaged.items():
        damage(make_step(tmp_path, step))
    (tmp_path / ".staging-step_000000600").mkdir()  # temp dirs are not steps
    (tmp_path / "notes.txt").write_text("hi")
    assert [s for s, _ in list_step_dirs(tmp_path)] == [100, 200, 300, 400, 500]
    best = latest_valid(tmp_path)
    assert best is not None and best.step == 100
    assert latest_valid(tmp_path / "nope") is None


def test_is_held(tmp_path: Path):
    d = make_step(tmp_path, 1)
    assert not is_held(d)
    (d / ".hold-replication").touch()
    assert is_held(d)
    assert verify_step_dir(d).valid  # a hold marker is not a data file
    assert not is_held(tmp_path / "missing")


# ------------------------------------------------------------ symlinks and non-regular files (issue #9)

def _retarget(d: Path, name: str, target: Path) -> None:
    """Replace ``d/name`` by a symlink to ``target`` and rewrite the listing manifests to match the
    target's bytes, so a verifier that follows the link would find size and checksum correct."""
    (d / name).unlink()
    os.symlink(target, d / name)
    for mpath in sorted(d.glob("manifest.rank_*.json")):
        m = RankManifest.from_json(mpath.read_bytes())
        if name in m.files:
            m.files[name] = hash_file(target)
            write_manifest(d, m)


@pytest.mark.parametrize("full", [True, False])
def test_symlinked_data_file_is_invalid(tmp_path: Path, full: bool):
    from rlsup_format.manifest import check_files, read_manifest

    root = tmp_path / "ckpt"
    older = make_step(root, 100)
    # A shard of another (valid) step, with the correct size and checksum behind the link.
    d = make_step(root, 200)
    _retarget(d, "rank_00000.pt", older / "rank_00000.pt")
    r = verify_step_dir(d, full=full)
    assert not r.valid and r.reason == "rank_00000.pt: a symbolic link (not followed)", r.reason
    # Garbage outside the checkpoint dir (think /etc/passwd), listed with its true checksum.
    outside = tmp_path / "passwd"
    outside.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 40)
    d = make_step(root, 300)
    _retarget(d, "rank_00001.pt", outside)
    assert not verify_step_dir(d, full=full).valid
    # A directory on the way that is a symlink (dcp/ pointing at another step's dcp/).
    real_dcp = tmp_path / "elsewhere" / "dcp"
    real_dcp.mkdir(parents=True)
    (real_dcp / "__0_0.distcp").write_bytes(b"tensor bytes")
    d = root / step_dir_name(400)
    d.mkdir()
    os.symlink(real_dcp, d / "dcp")
    files = {"dcp/__0_0.distcp": hash_file(real_dcp / "__0_0.distcp")}
    write_manifest(d, RankManifest(SCHEMA_VERSION, 400, 1, 0, "dcp", files, 1.0, "t", {}))
    r = verify_step_dir(d, full=full)
    assert not r.valid and "symbolic link" in r.reason, r.reason
    reason, _ = check_files(d, files, full=full)
    assert "symbolic link" in reason
    # The newest step that is really complete wins; nothing above verifies through a link.
    best = latest_valid(root, full=full)
    assert best is not None and best.step == 100
    # Reading one part's manifest refuses a symlinked manifest too.
    d5 = make_step(root, 500)
    (d5 / manifest_name(1)).unlink()
    os.symlink(d5 / manifest_name(0), d5 / manifest_name(1))
    with pytest.raises(OSError, match="symbolic link"):
        read_manifest(d5 / manifest_name(1))
    r = verify_step_dir(d5, full=full)
    assert not r.valid and "manifest.rank_00001.json" in r.reason and "symbolic link" in r.reason


def test_symlinked_manifest_from_another_step_is_invalid(tmp_path: Path):
    # Step 6's manifests are links to step 5's (same files, same checksums): following them would make
    # step 6 look like a copy of step 5.
    d5 = make_step(tmp_path, 5)
    d6 = tmp_path / step_dir_name(6)
    d6.mkdir()
    for rank in range(2):
        os.link(d5 / f"rank_{rank:05d}.pt", d6 / f"rank_{rank:05d}.pt")  # hard links are regular files
        m = RankManifest.from_json((d5 / manifest_name(rank)).read_bytes())
        m.step = 6
        (tmp_path / f"m6.{rank}.json").write_text(m.to_json())
        os.symlink(tmp_path / f"m6.{rank}.json", d6 / manifest_name(rank))
    r = verify_step_dir(d6)
    assert not r.valid and r.reason.startswith("unreadable manifest manifest.rank_00000.json"), r.reason


@pytest.mark.timeout(60)
def test_fifo_or_directory_instead_of_a_file_is_invalid_without_blocking(tmp_path: Path):
    d = make_step(tmp_path, 7)
    (d / "rank_00000.pt").unlink()
    os.mkfifo(d / "rank_00000.pt")  # opening it for reading would block forever without O_NONBLOCK
    for full in (True, False):
        r = verify_step_dir(d, full=full)
        assert not r.valid and r.reason == "rank_00000.pt: not a regular file", r.reason
    d = make_step(tmp_path, 8)
    (d / manifest_name(1)).unlink()
    os.mkfifo(d / manifest_name(1))
    r = verify_step_dir(d)
    assert not r.valid and "not a regular file" in r.reason, r.reason
    d = make_step(tmp_path, 9)
    (d / "rank_00001.pt").unlink()
    (d / "rank_00001.pt").mkdir()
    r = verify_step_dir(d)
    assert not r.valid and r.reason == "rank_00001.pt: not a regular file", r.reason
