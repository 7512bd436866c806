"""Lightning checkpoints: the real ModelCheckpoint writer SIGKILLed before each file event of a save
(tests/kill_matrix.py), half-written variants, and source-derived FSDP / DeepSpeed directories.

Every kill must leave rlsup's ``latest_valid`` on a complete step (step B only when B's named file is
complete, else step A); for some kill points Lightning's own ``ckpt_path="last"`` would resume from
nothing or from a torn ``last.ckpt`` (asserted: the failure rlsup protects against).
"""

from __future__ import annotations

from pathlib import Path


import lightning_builders as lb
from supervisor import layouts


def test_bench_tree(tmp_path: Path) -> None:
    lb.bench_tree(tmp_path, 20)
    record = layouts.latest_valid(tmp_path)
    assert record is not None and record.step == 19
