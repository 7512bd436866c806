"""Test files: made to a size, and compared by identity (inode, size, mtime)."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import xxhash

from rlsup_format import manifest
from rlsup_format.manifest import FileEntry, hash_file


def make_file(path: Path, size: int, seed: int = 0) -> FileEntry:
    """A file of ``size`` bytes whose content depends on ``seed``; returns its manifest entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    block = xxhash.xxh3_128_digest(str(seed).encode()) * 4096  # 64 KiB, cheap to make
    with open(path, "wb") as f:
        left = size
        while left:
            f.write(block[:min(left, len(block))])
            left -= min(left, len(block))
    return hash_file(path)


def file_stat(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime_ns) of ``path``, None when it is not there: changes when a save rewrites it."""
    try:
        s = path.stat()
    except FileNotFoundError:
        return None
    return s.st_ino, s.st_size, s.st_mtime_ns


def saved_step(root: Path, step: int, ranks: range, world: int, node_rank: int | None = None, age_s: float = 3600.0) -> Path:
    """An rlsup step as ``ranks`` of a job of ``world`` saved it ``age_s`` ago: one data file and one manifest each
    (``node_rank``: the node that wrote them, in the manifests' ``extra``)."""
    step_dir = root / manifest.step_dir_name(step)
    step_dir.mkdir(parents=True, exist_ok=True)
    then = time.time() - age_s
    for rank in ranks:
        name = f"rank_{rank:05d}.pt"
        entry = make_file(step_dir / name, 4096, seed=step * 1000 + rank)
        extra = {} if node_rank is None else {"node_rank": node_rank}
        manifest.write_manifest(step_dir, manifest.RankManifest(manifest.SCHEMA_VERSION, step, world, rank, "torch",
                                                                {name: entry}, then, "test", extra))
        for path in (step_dir / name, step_dir / manifest.manifest_name(rank)):
            os.utime(path, (then, then))
    return step_dir


def count_hashes(monkeypatch) -> Counter[str]:  # type: ignore[no-untyped-def]
    """Every checksum computed over a checkpoint file from now on, by ``step_dir/name`` (what reads every byte)."""
    counts: Counter[str] = Counter()
    real = manifest.hash_fd

    def counting(fd: int) -> FileEntry:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        counts[f"{path.parent.name}/{path.name}"] += 1
        return real(fd)
    monkeypatch.setattr(manifest, "hash_fd", counting)
    return counts
