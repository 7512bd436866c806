"""A small deterministic CPU trainer for rlsup: torch.distributed (gloo), heartbeats, trainer_hooks checkpoints.

Run it alone (one process), under torchrun, or under supervision:

    rlsup run -- torchrun --standalone --nproc-per-node 2 examples/train_tiny.py --crash-at-step 23

Faults for demos and tests (only on the attempt given by --fault-attempt, default the first):
``--crash-at-step N`` kills rank ``--fault-rank`` with SIGKILL after step N; ``--hang-at-step N`` makes it
stop heartbeating (a stuck collective). Every source of randomness (model init, data order, dropout,
a NumPy and a Python draw per step) is seeded and checkpointed, so a run that was killed and resumed
ends with bit-identical weights.

``--ddp`` wraps the model in DistributedDataParallel (gloo, CPU) instead of all-reducing each gradient by
hand, and calls ``trainer_hooks.prime_ddp`` after the restore so that every step reduces with DDP's final
bucket layout (``--no-prime`` leaves that out: a resume at 3+ ranks then differs in the last bits).
Checkpoints hold the unwrapped model's state either way.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import random
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainer_hooks
from trainer_hooks import CheckpointManager, ResumableSampler


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="Total optimizer steps.")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dataset-size", type=int, default=96, help="Samples; small so epochs roll over often.")
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--backend", default="torch", choices=["torch", "dcp", "megatron"])
    p.add_argument("--checkpoint-dir", default=None, help="Default: $RLSUP_CHECKPOINT_DIR.")
    p.add_argument("--step-time", type=float, default=0.02, help="Extra seconds per step, to look like work.")
    p.add_argument("--crash-at-step", type=int, default=None)
    p.add_argument("--hang-at-step", type=int, default=None)
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-attempt", type=int, default=0, help="Attempt (RLSUP_RESTART_COUNT) that gets the fault.")
    p.add_argument("--out", default=None, help="Rank 0 writes the final weights here.")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ballast-mb", type=int, default=0, help="Extra MB saved with each checkpoint (slower saves).")
    p.add_argument("--async-save", action="store_true", help="CheckpointManager(async_save=True).")
    p.add_argument("--ddp", action="store_true", help="Wrap the model in DistributedDataParallel when world > 1.")
    p.add_argument("--no-prime", action="store_true", help="With --ddp: skip trainer_hooks.prime_ddp (inexact resume).")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    attempt = int(os.environ.get("RLSUP_RESTART_COUNT", "0"))

    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)  # same init on every rank, like a broadcast

    g = torch.Generator().manual_seed(args.seed)
    xs = torch.randn(args.dataset_size, 16, generator=g)
    ys = xs @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(args.dataset_size, 1, generator=g)
    sampler = ResumableSampler(len(xs), num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    # Own generator: a DataLoader otherwise draws its base seed from the global torch RNG per epoch.
    loader = DataLoader(TensorDataset(xs, ys), batch_size=args.batch_size, sampler=sampler, num_workers=0,
                        generator=torch.Generator())

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    use_ddp = args.ddp and dist.is_initialized()
    # DDP averages the gradients in buckets during backward; checkpoints keep the unwrapped model's state.
    net = nn.parallel.DistributedDataParallel(model) if use_ddp else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    ckpt = CheckpointManager(args.checkpoint_dir, keep_last=args.keep_last, backend=args.backend,
                             async_save=args.async_save)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
    if args.ballast_mb:
        state["ballast"] = torch.zeros(args.ballast_mb * 2**18)  # float32: 4 bytes each
    # What lives as long as the run exists now (torch's modules, and torch._dynamo's, which the optimizer imported):
    # out of the garbage collector's way, as long-running trainers do (torchtitan manages its GC too). On 2 cores
    # that is also ~0.8 s less CPU at the exit, where Python's last collection would walk all of it.
    gc.freeze()

    step = ckpt.restore(state)
    if use_ddp and not args.no_prime:
        # Fix DDP's bucket layout (the order gradients are summed in) before the first real step, fresh or
        # resumed; the example batch is built without drawing random numbers.
        trainer_hooks.prime_ddp(net, torch.zeros(args.batch_size, 16))
    if rank == 0:
        print(f"[train_tiny] attempt {attempt}: starting at step {step} (world {world})", flush=True)

    while step < args.steps and not trainer_hooks.should_stop():
        for x, y in loader:
            noise = float(np.random.standard_normal()) * 1e-3 + random.random() * 1e-3
            loss = nn.functional.mse_loss(net(x) + noise, y)
            optimizer.zero_grad()
            loss.backward()
            if dist.is_initialized() and not use_ddp:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            optimizer.step()
            scheduler.step()
            step += 1
            trainer_hooks.heartbeat(step)
            if rank == 0 and step % 5 == 0:
                print(f"[train_tiny] step {step} loss {loss.item():.5f}", flush=True)
            if step % args.checkpoint_every == 0 or step == args.steps:
                ckpt.save(step, state)
            if attempt == args.fault_attempt and rank == args.fault_rank % world:
                if step == args.crash_at_step:
                    print(f"[train_tiny] rank {rank}: injected crash after step {step}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                if step == args.hang_at_step:
                    print(f"[train_tiny] rank {rank}: injected hang after step {step}", flush=True)
                    while True:
                        time.sleep(1)
            time.sleep(args.step_time)
            if step >= args.steps or trainer_hooks.should_stop():
                break
        else:
            sampler.set_epoch(sampler.epoch + 1)

    if trainer_hooks.should_stop() and step % args.checkpoint_every != 0:
        ckpt.save(step, state)  # preemption: save where we are before exiting
    ckpt.wait()
    if rank == 0 and args.out:
        torch.save(model.state_dict(), args.out)
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        print(f"[train_tiny] done at step {step}; weights sha256 {digest[:16]}", flush=True)
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
    # The process group goes last, once main's locals are gone. Destroyed while DDP still held it, the group would
    # die with DDP's reducer, whose destructor runs holding the GIL and joins gloo's threads, one of which may be
    # waiting for the GIL to free a finished collective: the process would hang at its end (pytorch/pytorch#56297).
    if dist.is_initialized():
        dist.destroy_process_group()
