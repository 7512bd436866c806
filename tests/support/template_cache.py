"""Checkpoints that real frameworks wrote, kept between test runs.

A fast test of a layout reads a tree built from one real save (Megatron-Core's dist checkpoint, Lightning's
``.ckpt``). Making that save imports the framework and trains a step: 4-6 s, the larger part of the fast tier
when paid on every run. The save is kept under ``$RLSUP_TEST_CACHE`` (default ``~/.cache/rlsup-tests``), in a
directory named for the framework's version, so a new version writes its own; the first run on a machine (a fresh
CI clone included) still makes it. Several pytest workers may build it at once: each builds into its own
directory and the first rename wins. Trees are built from it with hard links, so a test that wrote into one of its
files in place would change it for every later run: each use checks the files against the checksums recorded when
it was made, and a changed one is made again."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Callable

CACHE = Path(os.environ.get("RLSUP_TEST_CACHE") or Path.home() / ".cache" / "rlsup-tests")


def version_of(*distributions: str) -> str:
    """``name-version`` of each installed distribution (``name-none`` where it is absent): the cache key."""
    out = []
    for name in distributions:
        try:
            out.append(f"{name}-{metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(f"{name}-none")
    return "_".join(out)


def _checksums(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != COMPLETE}


COMPLETE = ".complete"  # written last, the checksums of every other file


def _intact(final: Path) -> bool:
    try:
        return json.loads((final / COMPLETE).read_text()) == _checksums(final)
    except (OSError, ValueError):
        return False


def cached(key: str, build: Callable[[Path], None]) -> Path:
    """The directory ``build`` fills, made once per ``key`` (and again if a file in it changed); ``build`` gets an
    empty directory to fill."""
    final = CACHE / key
    if _intact(final):
        return final
    CACHE.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=CACHE))
    try:
        build(work)
        (work / COMPLETE).write_text(json.dumps(_checksums(work)))
        try:
            os.rename(work, final)
        except OSError:  # another worker's is there (it renamed a finished build), or a changed one
            if not _intact(final):
                shutil.rmtree(final, ignore_errors=True)
                os.rename(work, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final
