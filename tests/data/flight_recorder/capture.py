"""Record the Flight Recorder dumps tests/diagnosis/test_flight_recorder_analysis.py reads: real 4-rank gloo runs
(torch 2.13 CPU, ``TORCH_FR_BUFFER_SIZE=2000``) in which rank 2 skips one all-reduce, each rank's
dump written by ``trainer_hooks.flight_recorder.write_dump`` (the thread rlsup's request wakes) once
every rank is stuck.

    .venv/bin/python tests/data/flight_recorder/capture.py   # rewrites both directories next to this script

- broadcast_instead/: each step is an all-reduce then a broadcast on the default group; rank 2 skips
  the all-reduce of step 5 and waits in the broadcast (#9) while the others wait in all-reduce #9.
- skipped_in_other_group/: tests/jobs/fr_skip_job.py (the job of tests/diagnosis/test_flight_recorder_e2e.py): rank 2
  skips the default group's all-reduce #4 and waits in all-reduce #4 of the "metrics" group (the same
  files as rlsup takes on that job's hang, ``rlsup run``, attempt 0).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def worker(case: str) -> None:
    sys.path.insert(0, str(ROOT))
    from trainer_hooks.flight_recorder import write_dump

    rank = int(os.environ["RANK"])

    def dump_when_stuck() -> None:
        time.sleep(6)
        write_dump(HERE / case / f"rank_{rank:05d}.fr.json")
        time.sleep(3)  # every rank has dumped before the first exit breaks the others' collectives
        os._exit(0)

    threading.Thread(target=dump_when_stuck, daemon=True).start()
    job = ROOT / "tests" / "jobs" / "fr_skip_job.py"
    if case == "skipped_in_other_group":
        os.environ["RLSUP_RESTART_COUNT"] = "0"
        exec(compile(job.read_text(), str(job), "exec"), {"__name__": "__main__"})
        return
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for step in range(1, 20):
        if not (rank == 2 and step == 5):
            dist.all_reduce(torch.ones(4) * step)
        dist.broadcast(torch.zeros(1), 0)


def main() -> None:
    for case in ("broadcast_instead", "skipped_in_other_group"):
        (HERE / case).mkdir(exist_ok=True)
        env = dict(os.environ, TORCH_FR_BUFFER_SIZE="2000", PYTHONPATH=str(ROOT))
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                        __file__, case], env=env, check=False, timeout=120)


if __name__ == "__main__":
    worker(sys.argv[1]) if len(sys.argv) > 1 else main()
