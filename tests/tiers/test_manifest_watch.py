"""The manifest watch wakes on a manifest put in place or a deletion, and is not handed the reads, opens
and write chunks that make up most of a busy checkpoint directory's traffic (real inotify, watchdog)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from rlsup_format.names import manifest_name
from supervisor.tiers.manifest_watch import ManifestWatch

CHUNKS = 300
READS = 100


def _busy(step_dir: Path) -> None:
    """A save written in small chunks, then read back and listed over and over, as scans and verifications do."""
    with open(step_dir / "model.pt", "wb") as f:
        for _ in range(CHUNKS):
            f.write(b"x" * 4096)
            f.flush()
    for _ in range(READS):
        (step_dir / "model.pt").read_bytes()
        os.listdir(step_dir)


@pytest.fixture
def watch(tmp_path: Path):
    wake = threading.Event()
    w = ManifestWatch(tmp_path / "ckpt", wake)
    w.start()
    try:
        yield w
    finally:
        w.stop()


def test_a_manifest_renamed_into_place_wakes_and_the_traffic_before_it_is_not_handed_over(watch: ManifestWatch) -> None:
    step_dir = watch.directory / "step_5"
    step_dir.mkdir()
    _busy(step_dir)
    assert not watch.wake.is_set()  # events come in order: nothing before the manifest wakes
    tmp = step_dir / ".manifest.tmp"
    tmp.write_text("{}")
    tmp.rename(step_dir / manifest_name(0))
    assert watch.wake.wait(10), "no wake within 10 s of a manifest renamed into place"
    # mkdir, the save's create and close, the temp file's create, close and move: a handful, not one per chunk or read
    assert watch.handler.events < 20, watch.handler.events


def test_a_deletion_wakes(watch: ManifestWatch) -> None:
    victim = watch.directory / "step_1"  # a step deleted (retention, a wiped disk): its parent's watch sees it
    victim.mkdir()
    victim.rmdir()
    assert watch.wake.wait(10), "no wake within 10 s of a deletion"
