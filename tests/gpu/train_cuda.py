"""A small deterministic CUDA trainer for the GPU tests: trainer_hooks checkpoints and heartbeats, one rank
or several under torchrun (NCCL when each rank has its own GPU, gloo with CUDA tensors when ranks share one).

Determinism: ``torch.use_deterministic_algorithms(True)`` with cuBLAS's fixed workspace, seeded CPU and CUDA
generators (trainer_hooks checkpoints both), so a run killed and resumed ends with weights equal to an
uninterrupted run's, bit for bit.

Faults, on the first attempt only: ``--crash-at-step N`` (SIGKILL after step N, its checkpoint may be mid
write), ``--hang-at-step N`` (a GPU kernel that spins for minutes, then a synchronize: the rank sits in CUDA,
silent, as a stuck collective or kernel leaves it), ``--oom-at-step N`` (asks for more GPU memory than the
card has: a real ``torch.OutOfMemoryError``).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS

import torch  # after the cuBLAS setting
import torch.distributed as dist
from torch import nn

import trainer_hooks
from trainer_hooks import CheckpointManager


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--checkpoint-dir", default=None, help="Default: $RLSUP_CHECKPOINT_DIR.")
    p.add_argument("--async-save", action="store_true", help="CheckpointManager(async_save=True): pinned copies.")
    p.add_argument("--width", type=int, default=1024, help="Hidden width: big enough that the GPU does work.")
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--crash-at-step", type=int, default=None)
    p.add_argument("--hang-at-step", type=int, default=None)
    p.add_argument("--oom-at-step", type=int, default=None)
    p.add_argument("--fault-rank", type=int, default=0)
    p.add_argument("--out", default=None, help="Rank 0 writes the final weights here.")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the same loop.")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = args.device == "cuda"
    device = torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        # NCCL needs one GPU per rank; ranks sharing a GPU reduce CUDA tensors over gloo instead.
        dist.init_process_group("nccl" if cuda and torch.cuda.device_count() >= world else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    attempt = int(os.environ.get("RLSUP_RESTART_COUNT", "0"))
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(1234)

    g = torch.Generator().manual_seed(1234)
    xs = torch.randn(512, args.width, generator=g).to(device)
    ys = torch.randn(512, 1, generator=g).to(device)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.GELU(), nn.Dropout(0.1),
                          nn.Linear(args.width, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = CheckpointManager(args.checkpoint_dir, keep_last=3, async_save=args.async_save)
    state = {"model": model, "optimizer": optimizer}
    step = ckpt.restore(state)
    if rank == 0:
        print(f"[train_cuda] attempt {attempt}: starting at step {step} on "
              f"{torch.cuda.get_device_name(device) if cuda else 'cpu'}",
              flush=True)
    first = True
    while step < args.steps and not trainer_hooks.should_stop():
        idx = torch.randint(0, len(xs), (64,), device=device)  # the CUDA generator: checkpointed
        loss = nn.functional.mse_loss(model(xs[idx]), ys[idx])
        optimizer.zero_grad()
        loss.backward()
        if dist.is_initialized():
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        optimizer.step()
        step += 1
        trainer_hooks.heartbeat(step)
        if rank == 0 and first:
            if cuda:
                torch.cuda.synchronize(device)
            print(f"[train_cuda] attempt {attempt}: first step done at {time.time():.3f}", flush=True)
            first = False
        if step % args.checkpoint_every == 0 or step == args.steps:
            ckpt.save(step, state)
        if attempt == 0 and rank == args.fault_rank:
            _fault(args, step, rank, device)
        if args.step_time:
            time.sleep(args.step_time)
    ckpt.wait()
    if rank == 0 and args.out:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, args.out)
        print(f"[train_cuda] done at step {step}", flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _fault(args: argparse.Namespace, step: int, rank: int, device: torch.device) -> None:
    """The injected faults of the first attempt (see the module docstring)."""
    if step == args.crash_at_step:
        print(f"[train_cuda] rank {rank}: injected crash after step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if step == args.hang_at_step:
        print(f"[train_cuda] rank {rank}: injected GPU hang after step {step}", flush=True)
        if device.type != "cuda":
            while True:
                time.sleep(1)
        torch.cuda._sleep(2**62)  # a spin kernel far longer than any test
        torch.cuda.synchronize(device)
    if step == args.oom_at_step:
        print(f"[train_cuda] rank {rank}: asking for more GPU memory than the card has", flush=True)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.empty(2 * total, dtype=torch.uint8, device=device)


if __name__ == "__main__":
    main()
