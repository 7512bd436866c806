"""A tiny CPU trainer (gloo) that reports to NVRx's fault-tolerance rank monitor AND to rlsup.

Meant to run as ``rlsup run -- ft_launcher ... examples/train_nvrx.py`` (see docs/nvrx.md):

    rlsup run -- ft_launcher --standalone --nproc-per-node 2 --max-restarts 0 \\
        --ft-enable-nic-monitor false examples/train_nvrx.py --crash-at-step 13

- NVRx: every rank opens a ``RankMonitorClient`` (``init_workload_monitoring``), calls ``send_heartbeat``
  after each step, saves the client's ``state_dict`` (learned timeouts, if any) with the checkpoint
  and loads it back on resume, and calls ``shutdown_workload_monitoring`` at the end. With
  ``--nvrx-learn-timeouts`` it also lets NVRx learn its heartbeat timeouts
  (``calculate_and_set_hb_timeouts``, a gloo collective) at every checkpoint. ft_launcher puts the monitor's
  socket into ``FT_RANK_MONITOR_IPC_SOCKET``; without it (plain torchrun, one process) the NVRx
  client is skipped, so the script also runs without NVRx installed.
- rlsup: ``trainer_hooks.heartbeat(step)`` after each step (a shared-memory store, independent of
  NVRx's socket round trip), ``trainer_hooks.CheckpointManager`` for verified saves and the resume
  rlsup chose (``RLSUP_RESUME_DIR``), ``trainer_hooks.should_stop()`` for preemption.

Under ft_launcher the ranks get torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT,
TORCHELASTIC_RESTART_COUNT, ...) plus ``FT_RANK_MONITOR_IPC_SOCKET`` and ``FT_LAUNCHER_IPC_SOCKET``;
the attempt number that matters for fault injection is rlsup's ``RLSUP_RESTART_COUNT`` (ft_launcher
runs with ``--max-restarts 0``, so its own restart count stays 0).

Batches are drawn from a generator seeded by (seed, step, rank), so a run that was killed and resumed
from a checkpoint ends with the same weights as one that never failed (rank 0 prints a digest).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

import trainer_hooks
from trainer_hooks import CheckpointManager

FT_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--checkpoint-dir", default=None, help="Default: $RLSUP_CHECKPOINT_DIR.")
    p.add_argument("--step-time", type=float, default=0.02, help="Extra seconds per step, to look like work.")
    p.add_argument("--crash-at-step", type=int, default=None, help="SIGKILL --fault-rank after this step.")
    p.add_argument("--hang-at-step", type=int, default=None, help="--fault-rank stops heartbeating after this step.")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-attempt", type=int, default=0, help="RLSUP_RESTART_COUNT that gets the fault.")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-nvrx", action="store_true", help="Skip the NVRx client even under ft_launcher.")
    p.add_argument("--nvrx-learn-timeouts", action="store_true",
                   help="Let NVRx set its heartbeat timeouts from the intervals seen (safety_factor x the longest, "
                        "no floor: with fast steps that is a fraction of a second, see docs/nvrx.md).")
    return p.parse_args()


class NvrxMonitor:
    """NVRx's RankMonitorClient when this rank runs under ft_launcher; every call a no-op otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.client = None
        if not enabled or not os.environ.get(FT_SOCKET_ENV):
            return
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        self.client = RankMonitorClient()

    @property
    def active(self) -> bool:
        return self.client is not None

    def start(self, state: dict | None) -> None:
        if self.client is None:
            return
        if state:
            self.client.load_state_dict(state)  # timeouts learned in an earlier attempt
        self.client.init_workload_monitoring()

    def heartbeat(self) -> None:
        if self.client is not None:
            self.client.send_heartbeat()

    def learn_timeouts(self) -> None:
        """Collective (all ranks at the same step): NVRx sets its timeouts from the intervals it saw."""
        if self.client is not None:
            self.client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)

    def state_dict(self) -> dict:
        return dict(self.client.state_dict()) if self.client is not None else {}

    def timeouts(self) -> str:
        return str(self.client.hb_timeouts) if self.client is not None else "n/a"

    def stop(self) -> None:
        if self.client is not None:
            self.client.shutdown_workload_monitoring()


def batch(seed: int, step: int, rank: int, size: int, w_true: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    x = torch.randn(size, 16, generator=g)
    return x, x @ w_true + 0.05 * torch.randn(size, 1, generator=g)


def main() -> None:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    attempt = int(os.environ.get("RLSUP_RESTART_COUNT", "0"))

    torch.manual_seed(args.seed)  # same init on every rank
    w_true = torch.randn(16, 1, generator=torch.Generator().manual_seed(args.seed))
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = CheckpointManager(args.checkpoint_dir, keep_last=args.keep_last)
    nvrx = NvrxMonitor(enabled=not args.no_nvrx)
    state: dict = {"model": model, "optimizer": optimizer, "nvrx": {}}

    step = ckpt.restore(state)
    nvrx.start(state["nvrx"])
    if rank == 0:
        print(f"[train_nvrx] attempt {attempt}: starting at step {step} (world {world}, "
              f"nvrx {'on' if nvrx.active else 'off'}, ft restart count "
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '-')})", flush=True)

    while step < args.steps and not trainer_hooks.should_stop():
        x, y = batch(args.seed, step, rank, args.batch_size, w_true)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        if dist.is_initialized():
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        optimizer.step()
        step += 1
        trainer_hooks.heartbeat(step)  # rlsup: a memory store, ~1 us
        nvrx.heartbeat()               # NVRx: a pickled message over a Unix socket, and a reply
        if rank == 0 and step % 5 == 0:
            print(f"[train_nvrx] step {step} loss {loss.item():.5f}", flush=True)
        if step % args.checkpoint_every == 0 or step == args.steps:
            if args.nvrx_learn_timeouts:
                nvrx.learn_timeouts()
            state["nvrx"] = nvrx.state_dict()
            ckpt.save(step, state)
        if attempt == args.fault_attempt and rank == args.fault_rank % world:
            if step == args.crash_at_step:
                print(f"[train_nvrx] rank {rank}: injected crash after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.hang_at_step:
                print(f"[train_nvrx] rank {rank}: injected hang after step {step}", flush=True)
                while True:
                    time.sleep(1)
        time.sleep(args.step_time)

    if trainer_hooks.should_stop() and step % args.checkpoint_every != 0:
        state["nvrx"] = nvrx.state_dict()
        ckpt.save(step, state)  # preemption: save where we are before exiting
    ckpt.wait()
    if rank == 0:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        print(f"[train_nvrx] done at step {step}; nvrx timeouts {nvrx.timeouts()}; weights sha256 {digest[:16]}",
              flush=True)
    nvrx.stop()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
