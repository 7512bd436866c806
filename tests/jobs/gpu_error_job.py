"""A job that fails the way a GPU rank does, on CPU, for tests/diagnosis/test_gpu_failures_e2e.py.

``gpu_error_job.py TEXT_FILE print``: on the first attempt (``RLSUP_RESTART_COUNT`` 0) writes ``marker`` into
``RLSUP_CHECKPOINT_DIR``, prints the recorded output TEXT_FILE (tests/data/gpu_errors/) to stderr and exits 1, as
a rank whose exception ended it does; later attempts exit 0. ``raise``: the first attempt raises the real
``torch.OutOfMemoryError`` class with the recorded message of TEXT_FILE (an ``.error.json``) from a ``@record``
entry point, so torchrun writes its structured error file (a real CUDA OOM needs a GPU).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    text_file, mode = Path(sys.argv[1]), sys.argv[2]
    if os.environ.get("RLSUP_RESTART_COUNT", "0") != "0":
        print("[gpu_error_job] later attempt: done", flush=True)
        return
    ckpt = Path(os.environ["RLSUP_CHECKPOINT_DIR"])
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "marker").write_text("written before the failure\n")
    if mode == "print":
        sys.stderr.write(text_file.read_text())
        sys.stderr.flush()
        sys.exit(1)
    import torch

    message = json.loads(text_file.read_text())["message"]["message"]
    raise torch.OutOfMemoryError(message.split(": ", 1)[1])


if __name__ == "__main__":
    main()
