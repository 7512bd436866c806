"""The trainer of the shrink benchmark (benchmarks/bench_shrink.py): one rank per node, DDP, gloo, CPU, whose saves
rlsup may restore into another world size (issue 43).

A data-parallel MLP (``--width`` x ``--width`` layers, SGD with momentum) wrapped in DistributedDataParallel: at the
default width 2500 the state is 12.5 M parameters + as many momentum values, **100 MB per rank**. Its saves are
resizable: trainer_hooks' torch backend, a :class:`~trainer_hooks.ResumableSampler` in the state (the data position
is global), DDP and SGD (replicated). The global batch is kept across world sizes by gradient accumulation:
``--global-micro-batches`` micro batches of ``--micro-batch`` rows per optimizer step over all ranks
(:func:`trainer_hooks.grad_accum_steps`: 6 gives 2 per rank in 3 ranks, 3 per rank in 2).

Events (JSON lines, ``time.monotonic()``, as benchmarks/jobs/recovery_trainer.py's, so
benchmarks/node_loss_accounting.py accounts them): start, rendezvous, resumed (step, world, and saved_world after a
world change), step (step, dur: compute + all-reduce + optimizer, the save excluded; world), save (step, dur).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import job_events
import trainer_hooks
from trainer_hooks import CheckpointManager, ResumableSampler, grad_accum_steps

SAMPLES = 1_000_000  # far more than a trial consumes: no epoch ends in a benchmark run


class Indices(Dataset):
    """Sample ``i`` is its index; the rows are drawn from a generator seeded by it (:func:`rows`)."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> int:
        return i


def rows(ids: torch.Tensor, width: int) -> torch.Tensor:
    """The inputs of samples ``ids``: fixed by each id, whichever rank or world draws them."""
    return torch.stack([torch.randn(width, generator=torch.Generator().manual_seed(int(i))) for i in ids])


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", required=True)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--steps", type=int, default=10**9)
    p.add_argument("--width", type=int, default=2500, help="2500: 100 MB of weights + momentum per rank")
    p.add_argument("--micro-batch", type=int, default=8, help="rows per micro batch")
    p.add_argument("--global-micro-batches", type=int, default=6,
                   help="micro batches per optimizer step over all ranks (the global batch, kept in any world)")
    p.add_argument("--checkpoint-every", type=int, default=1)
    return p.parse_args()


def main() -> None:
    args = parse()
    job = job_events.start(args.events)
    rank, world, emit = job.rank, job.world, job.emit

    torch.manual_seed(0)  # the same initial weights on every rank
    w = args.width
    model = nn.Sequential(nn.Linear(w, w), nn.Tanh(), nn.Linear(w, w), nn.Tanh(), nn.Linear(w, 1))
    net = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9)
    for prm in net.parameters():  # the momentum buffers exist from the start: the state is whole at step 0
        optimizer.state[prm]["momentum_buffer"] = torch.zeros_like(prm)
    sampler = ResumableSampler(SAMPLES, shuffle=True, seed=7)
    loader = DataLoader(Indices(), batch_size=args.micro_batch, sampler=sampler, num_workers=0,
                        generator=torch.Generator())
    ckpt = CheckpointManager(args.checkpoint_dir, keep_last=2)
    state = {"model": net, "optimizer": optimizer, "sampler": sampler}
    step = ckpt.restore(state)
    if rank == 0:
        change = ckpt.world_change
        emit("resumed", step=step, world=world, **({"saved_world": change.saved_world_size} if change else {}))
    trainer_hooks.prime_ddp(net, torch.zeros(args.micro_batch, w))
    accum = grad_accum_steps(args.global_micro_batches * args.micro_batch, args.micro_batch, world)
    batches = iter(loader)

    while step < args.steps:
        t0 = time.monotonic()
        optimizer.zero_grad()
        for i in range(accum):
            with contextlib.nullcontext() if i == accum - 1 else net.no_sync():
                (net(rows(next(batches), w)).pow(2).mean() / accum).backward()
        optimizer.step()
        step += 1
        trainer_hooks.heartbeat(step)
        job.stepped(step, t0, world=world)
        job.save_every(args.checkpoint_every, step, lambda: ckpt.save(step, state))
    ckpt.wait()
    job.finish(step)


if __name__ == "__main__":
    main()
