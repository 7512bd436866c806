"""A tight loop of small gloo all-reduces, for benchmarks/run.py's ``flight_recorder`` figure.

    torchrun --standalone --nproc-per-node 2 bench_fr_collectives.py BLOCKS PER_BLOCK SCRATCH_DIR

Rank 0 prints ``RESULT {json}``: the median over blocks of the time per all-reduce (microseconds) and,
where the Flight Recorder is on (``TORCH_FR_BUFFER_SIZE`` > 0), the time and size of one JSON dump of
its full ring. With FR on, rlsup's FR thread (trainer_hooks.flight_recorder) waits on its FIFO as it
does under rlsup, so its cost is in the figure too.
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
blocks, per_block, scratch = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
fr_on = int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0")) > 0
if fr_on:
    from trainer_hooks.flight_recorder import start_listener

    assert start_listener(scratch, rank)
tensor = torch.ones(4)
for _ in range(500):  # warm-up, and a full ring (2000 entries) before the timed blocks
    dist.all_reduce(tensor)
per_op = []
for _ in range(blocks):
    t0 = time.perf_counter()
    for _ in range(per_block):
        dist.all_reduce(tensor)
    per_op.append((time.perf_counter() - t0) / per_block * 1e6)
result = {"us": statistics.median(per_op)}
if fr_on:
    from torch._C._distributed_c10d import _dump_fr_trace_json

    t0 = time.perf_counter()
    body = _dump_fr_trace_json()
    result.update(dump_ms=(time.perf_counter() - t0) * 1e3, dump_bytes=len(body), entries=len(json.loads(body)["entries"]))
if rank == 0:
    print("RESULT " + json.dumps(result), flush=True)
dist.destroy_process_group()
