"""The trainer of the realistic recovery harness (benchmarks/bench_recovery.py): 2 ranks, gloo, CPU.

A data-parallel MLP (``--width`` x ``--width`` layers, SGD with momentum): with the default width 2048
the state is 8.4 M parameters + as many momentum values, 67 MB per rank. A step is real torch work:
``--micro-batches`` forward/backward passes of ``--batch`` rows (gradient accumulation), one gloo
all-reduce per parameter (33.6 MB of gradients) and the optimizer step; the harness picks
``--micro-batches`` so that a step takes about 0.5 s on the machine (``--calibrate``).

Two ways to save, as users of each launcher do:

    hooks   trainer_hooks.CheckpointManager (what rlsup's memory tier needs: under ``rlsup run
            --memory-dir`` each save lands in RAM, rlsup drains every ``--disk-every``-th to disk)
    torch   torch.save of each rank's state to ``<ckpt>/step_<N>/rank<r>.pt`` (temp file, rename), the
            two newest steps kept; resume from the newest step every rank's file is in (no fsync, as
            most trainers: the page cache takes it)

Events (JSON lines, ``time.monotonic()``, same meaning as benchmarks/jobs/bench_trainer.py): start,
rendezvous, resumed (step), step (step, dur: compute + all-reduce + optimizer, saves excluded), save
(step, dur: the time the loop was blocked).
"""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import job_events
import trainer_hooks
from trainer_hooks import CheckpointManager

STEP_DIR = re.compile(r"^step_(\d+)$")


class TorchSaver:
    """Plain torch.save checkpoints, one file per rank and step (what a trainer without rlsup writes)."""

    def __init__(self, root: str, rank: int, world: int) -> None:
        self.root, self.rank, self.world = Path(root), rank, world
        self.saved: list[int] = []

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        found = (STEP_DIR.match(p.name) for p in self.root.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        for step in reversed(self.steps()):
            files = [self.root / f"step_{step}" / f"rank{r}.pt" for r in range(self.world)]
            if all(f.exists() for f in files):
                state = torch.load(files[self.rank], weights_only=True)
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
                self.saved = [s for s in self.steps() if s <= step]  # pruned as this attempt saves
                return step
        return 0

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        d = self.root / f"step_{step}"
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"rank{self.rank}.pt.tmp"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
        os.replace(tmp, d / f"rank{self.rank}.pt")
        self.saved = [s for s in self.saved if s != step] + [step]
        for old in self.saved[:-2]:  # this rank's own files of steps older than the two newest
            (self.root / f"step_{old}" / f"rank{self.rank}.pt").unlink(missing_ok=True)
            try:
                (self.root / f"step_{old}").rmdir()  # the last rank out removes the directory
            except OSError:
                pass
        self.saved = self.saved[-2:]

    def wait(self) -> None:
        """Saves are synchronous."""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", required=True)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--steps", type=int, default=10**9)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--saver", choices=("hooks", "torch"), default="hooks")
    p.add_argument("--checkpoint-every", type=int, default=1, help="0: never save")
    p.add_argument("--async-save", action="store_true", help="CheckpointManager(async_save=True) (hooks)")
    return p.parse_args()


def main() -> None:
    args = parse()
    job = job_events.start(args.events)
    rank, world, emit = job.rank, job.world, job.emit

    torch.manual_seed(0)
    w = args.width
    model = nn.Sequential(nn.Linear(w, w), nn.Tanh(), nn.Linear(w, w), nn.Tanh(), nn.Linear(w, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    for prm in model.parameters():  # the momentum buffers exist from the start: the state is whole at step 0
        optimizer.state[prm]["momentum_buffer"] = torch.zeros_like(prm)
    if args.saver == "hooks":
        ckpt = CheckpointManager(args.checkpoint_dir, keep_last=2, async_save=args.async_save)
        state = {"model": model, "optimizer": optimizer}
        step = ckpt.restore(state)
    else:
        ckpt = TorchSaver(args.checkpoint_dir, rank, world)
        step = ckpt.restore(model, optimizer)
    if rank == 0:
        emit("resumed", step=step)

    while step < args.steps:
        t0 = time.monotonic()
        optimizer.zero_grad()
        for mb in range(args.micro_batches):
            g = torch.Generator().manual_seed((step * 64 + mb) * 7 + rank)
            x = torch.randn(args.batch, w, generator=g)
            model(x).pow(2).mean().backward()
        if world > 1:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
        optimizer.step()
        step += 1
        trainer_hooks.heartbeat(step)
        job.stepped(step, t0)
        if args.saver == "hooks":
            job.save_every(args.checkpoint_every, step, lambda: ckpt.save(step, state))
        else:
            job.save_every(args.checkpoint_every, step, lambda: ckpt.save(step, model, optimizer))
    ckpt.wait()
    job.finish(step)


if __name__ == "__main__":
    main()
