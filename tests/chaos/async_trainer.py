"""``examples/train_tiny.py`` with asynchronous saves: ``CheckpointManager(async_save=True)``.

The chaos suite runs this instead of the example trainer to put a checkpoint writer *process* under
fault: every ``save()`` returns once the state is copied, and ``python -m trainer_hooks.async_writer``
(a child of the rank) writes it with the atomic protocol while training goes on. Same arguments as
train_tiny.py; the final weights must equal a synchronous, uninterrupted run's.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "examples" / "train_tiny.py")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

if __name__ == "__main__":
    sys.argv[0] = TRAIN
    if "--async-save" not in sys.argv:
        sys.argv.append("--async-save")  # train_tiny.py's own flag: CheckpointManager(async_save=True)
    runpy.run_path(TRAIN, run_name="__main__")
