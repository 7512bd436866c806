"""A worker that fails the way a GPU job does, for record.py (run under torchrun or plain python, on CUDA).

``oom``: asks for twice the card's memory (a real ``torch.OutOfMemoryError``); ``assert``: an out-of-range
index on the GPU (a real device-side assert, a CUDA error); ``nccl_dup``: two ranks on one GPU (NCCL refuses:
a real NCCL error). The entry point is ``@record``, so torchrun writes its structured error file.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    case = sys.argv[1]
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    if case == "oom":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.empty(2 * total, dtype=torch.uint8, device=device)
    elif case == "assert":
        x = torch.zeros(3, device=device)
        print(x[torch.tensor([10], device=device)].sum().item())
    elif case == "nccl_dup":
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60))
        t = torch.ones(4, device=device)
        dist.all_reduce(t)
        torch.cuda.synchronize()
        print(f"rank {os.environ.get('RANK')}: all_reduce gave {t.tolist()}")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
