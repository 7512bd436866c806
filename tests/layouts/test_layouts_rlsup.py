"""rlsup's own format through rlsup_format.manifest (skipped until that module exists)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor import layouts

checkpoint = pytest.importorskip(
    "trainer_hooks.checkpoint", reason="trainer_hooks.checkpoint/manifest (a colleague's module) not present yet"
)
pytest.importorskip("rlsup_format.manifest", reason="rlsup_format.manifest not present yet")


def test_rlsup_steps_through_manifest_verifier(tmp_path: Path) -> None:
    import torch

    mgr = checkpoint.CheckpointManager(directory=tmp_path, backend="torch")
    for s in (1, 2, 3):
        mgr.save(s, {"w": torch.full((4,), float(s))})
    assert layouts.detect_layout(tmp_path) == "rlsup"
    assert [r.step for r in layouts.scan(tmp_path)] == [1, 2, 3]
    step3 = layouts.latest_valid(tmp_path).path
    victim = max((p for p in step3.rglob("*") if p.is_file() and not p.name.startswith("manifest.")),
                 key=lambda p: p.stat().st_size)
    data = victim.read_bytes()
    victim.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # same size, flipped byte: only checksums see it
    rec = layouts.verify_path(step3)
    assert not rec.valid and rec.layout == "rlsup"
    assert layouts.latest_valid(tmp_path).step == 2
