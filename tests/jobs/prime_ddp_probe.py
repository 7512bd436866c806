"""One rank, in its own process: prime_ddp rebuilds DDP's buckets once and leaves RNG, buffers and existing
grads untouched; a non-DDP module is ignored. Prints PRIMED when every check passed.

Its own process because a gloo group torn down while a DDP reducer still holds it can deadlock in C++
(the group's destructor joins a worker that waits for the GIL), out of reach of pytest-timeout's SIGALRM:
in CI that stalled the whole suite. Here the model is dropped before the group, and faulthandler ends a
stall with every thread's stack.
"""
import faulthandler
import gc
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from trainer_hooks import prime_ddp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared one-rank group
from layout_builders import init_one_rank_gloo

if not __debug__:
    sys.exit("prime_ddp_probe: its checks are asserts; run it without -O / PYTHONOPTIMIZE")
faulthandler.dump_traceback_later(90, exit=True)
assert prime_ddp(nn.Linear(4, 1), torch.zeros(2, 4)) is False
init_one_rank_gloo()

net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))
model = nn.parallel.DistributedDataParallel(net)
net[0].weight.grad = torch.full_like(net[0].weight, 3.0)  # e.g. accumulated before the call
buffers = [b.clone() for b in net.buffers()]
rng = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
assert prime_ddp(model, torch.zeros(5, 4)) is True
assert torch.equal(rng[0], torch.get_rng_state()) and rng[1] == random.getstate()
assert (rng[2] == np.random.get_state()[1]).all()
assert all(torch.equal(a, b) for a, b in zip(buffers, net.buffers()))
assert torch.equal(net[0].weight.grad, torch.full_like(net[0].weight, 3.0))
assert all(p.grad is None for p in list(net.parameters())[1:])
assert prime_ddp(model, torch.zeros(5, 4)) is False  # already rebuilt
model(torch.ones(5, 4)).sum().backward()  # and real steps still work
print("PRIMED", flush=True)

del model, net  # the reducer lets go of the group before the group is destroyed
gc.collect()
dist.destroy_process_group()
sys.exit(0)
