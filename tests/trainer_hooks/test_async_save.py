"""CheckpointManager(async_save=True): short blocking, a true snapshot, flush on wait/atexit/preemption,
and SIGKILL of the trainer or of the writer process never leaves a valid-looking partial checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer_hooks import CheckpointManager
from trainer_hooks.triggers import SaveTrigger


def test_async_needs_torch_backend(tmp_path: Path) -> None:
    with pytest.raises(NotImplementedError, match="torch"):
        CheckpointManager(tmp_path, backend="dcp", async_save=True)
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, async_save=True, when_busy="later")


def test_save_trigger() -> None:
    now = [0.0]
    t = SaveTrigger(every_steps=10, every_seconds=60, on_epoch_end=True, on_preemption=False,
                    clock=lambda: now[0])
    assert [s for s in range(1, 25) if t.should_save(s)] == [10, 20]
    assert not t.should_save(20)  # the same step never fires twice
    assert t.should_save(21, epoch_end=True) and t.last_reason == "epoch_end"
    now[0] = 61.0
    assert t.should_save(22) and t.last_reason == "time"
    assert not t.should_save(23)  # the time interval restarted
    with pytest.raises(ValueError):
        SaveTrigger(every_steps=0)
