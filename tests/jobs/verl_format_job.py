"""An unmodified trainer (no trainer_hooks) that prints its progress as verl does, then freezes.

verl's console logger (verl/utils/logger/aggregate_logger.py, concat_dict_to_str, verl 0.9.1) prints
``step:{step}`` followed by `` - key:value`` for each numeric metric; under Ray the driver prefixes an
actor's lines with ``(TaskRunner pid=N)``. argv: steps freeze_at (0: never); the freeze happens on
attempt 0 only (RLSUP_RESTART_COUNT), inside a function the stacks must show.
"""
import os
import pprint
import sys
import time

steps, freeze_at = int(sys.argv[1]), int(sys.argv[2])
attempt = int(os.environ.get("RLSUP_RESTART_COUNT", "0"))
start = int(os.environ.get("RLSUP_RESUME_STEP") or 0)


def concat_dict_to_str(metrics: dict, step: int) -> str:  # verl's, verbatim in behaviour
    return " - ".join([f"step:{step}"] + [f"{k}:{pprint.pformat(v)}" for k, v in metrics.items()])


def wait_for_rollout() -> None:
    while True:  # a rollout worker that never answers
        time.sleep(1)


for step in range(start + 1, steps + 1):
    time.sleep(0.1)
    if attempt == 0 and step == freeze_at:
        wait_for_rollout()
    print(f"(TaskRunner pid={os.getpid()}) " + concat_dict_to_str(
        {"actor/entropy": 0.61, "actor/pg_loss": -0.003, "timing_s/step": 0.1}, step), flush=True)
print("training done", flush=True)
