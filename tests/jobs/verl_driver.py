"""What verl's RayPPOTrainer does around checkpoints, on CPU, through verl 0.9.1's own code (issue 20).

verl's ``main_ppo`` needs Ray workers, vLLM and GPUs; this driver reproduces the part rlsup sees:

* every rank holds a tiny ``LlamaForCausalLM`` wrapped in torch FSDP (CPU, gloo) with an AdamW optimizer
  and an LR scheduler; ``verl.utils.checkpoint.fsdp_checkpoint_manager.FSDPCheckpointManager`` saves
  it to ``<ckpt>/global_step_N/actor`` (``actor_rollout_wg.save_checkpoint`` in verl);
* then rank 0 (verl's single-controller driver) saves the dataloader state to
  ``global_step_N/data.pt`` and writes ``latest_checkpointed_iteration.txt`` with a plain
  ``open("w")``, in the order of ``verl/trainer/ppo/ray_trainer.py`` ``_save_checkpoint``;
* ``trainer.resume_mode=auto`` (``_load_checkpoint``): the step folder comes from verl's own
  ``find_latest_ckpt_path`` (the tracker), the manager loads it, then ``data.pt``;
* each step's metrics go through verl's console logger ``LocalLogger`` (``step:N - key:value``).

It never imports ``trainer_hooks``: an unmodified trainer. Test knobs: ``VERL_DRIVER_FREEZE_AT=N``
makes attempt 0 (``RLSUP_RESTART_COUNT`` unset or 0) sleep forever before step N; killing mid-save
is done from outside by ``tests/kill_matrix.py``'s hook.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader  # verl's dataloader


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--default-local-dir", required=True, help="trainer.default_local_dir")
    p.add_argument("--total-steps", type=int, default=6, help="trainer.total_training_steps")
    p.add_argument("--save-freq", type=int, default=2, help="trainer.save_freq")
    p.add_argument("--resume-mode", default="auto", help="trainer.resume_mode")
    p.add_argument("--step-seconds", type=float, default=0.0, help="extra time per step (hang tests)")
    return p.parse_args()


def build(rank: int):
    """Tiny model, FSDP on CPU, optimizer, scheduler, verl's checkpoint manager, a stateful dataloader."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = FSDP(LlamaForCausalLM(config), device_id=torch.device("cpu"), use_orig_params=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    manager = FSDPCheckpointManager(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                    checkpoint_config=None)
    return model, optimizer, scheduler, manager, make_loader(rank)


def make_loader(rank: int) -> StatefulDataLoader:
    """verl's stateful dataloader over a fixed random token set (its state goes into data.pt)."""
    data = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(rank))
    return StatefulDataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))


def save_checkpoint(local_dir: str, step: int, manager, loader: DataLoader, rank: int) -> None:
    """ray_trainer.py ``_save_checkpoint``: actor via the manager, then data.pt, then the tracker."""
    folder = os.path.join(local_dir, f"global_step_{step}")
    if rank == 0:
        print(f"local_global_step_folder: {folder}", flush=True)
    manager.save_checkpoint(os.path.join(folder, "actor"), None, step, max_ckpt_to_keep=None)
    if rank == 0:  # the single controller does the rest
        controller_save(local_dir, step, loader)
    dist.barrier()


def controller_save(local_dir: str, step: int, loader: DataLoader) -> None:
    """The driver's part of ``_save_checkpoint`` once the workers saved: data.pt, then the tracker."""
    from verl.utils.fs import local_mkdir_safe

    folder = os.path.join(local_dir, f"global_step_{step}")
    local_mkdir_safe(folder)
    torch.save(loader.state_dict(), os.path.join(folder, "data.pt"))
    with open(os.path.join(local_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(step))


def load_checkpoint(local_dir: str, mode: str, manager, loader: DataLoader) -> int:
    """ray_trainer.py ``_load_checkpoint`` for resume_mode auto: the tracker decides the step."""
    step, global_step_folder = resume_point(local_dir, mode)
    if global_step_folder is None:
        return 0
    manager.load_checkpoint(os.path.join(global_step_folder, "actor"))
    load_data(global_step_folder, loader)
    return step


def resume_point(local_dir: str, mode: str) -> tuple[int, str | None]:
    """The step and folder verl resumes from: its own ``find_latest_ckpt_path`` reads the tracker."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    if mode == "disable":
        return 0, None
    global_step_folder = find_latest_ckpt_path(os.path.abspath(local_dir))
    if global_step_folder is None:
        print("Training from scratch", flush=True)
        return 0, None
    print(f"Load from checkpoint folder: {global_step_folder}", flush=True)
    step = int(global_step_folder.split("global_step_")[-1])
    print(f"Setting global step to {step}", flush=True)
    print(f"Resuming from {global_step_folder}", flush=True)
    return step, global_step_folder


def load_data(global_step_folder: str, loader: DataLoader) -> None:
    data_path = os.path.join(global_step_folder, "data.pt")
    if os.path.exists(data_path):
        loader.load_state_dict(torch.load(data_path, weights_only=False))
    else:
        print(f"Warning: No dataloader state found at {data_path}, will start from scratch", flush=True)


def train_step(model, optimizer, scheduler, batch: torch.Tensor, step_seconds: float) -> dict:
    """One update (``update_actor`` in verl's worker); the metrics verl logs for it."""
    start = time.monotonic()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    grad_norm = model.clip_grad_norm_(1.0).item()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    time.sleep(step_seconds)
    return {"actor/pg_loss": round(loss.item(), 4), "actor/grad_norm": round(grad_norm, 4),
            "actor/lr": scheduler.get_last_lr()[0], "timing_s/step": round(time.monotonic() - start, 3)}


def freeze_here(step: int) -> None:
    """A collective that never returns, as a stuck NCCL call looks from outside: no more output."""
    print(f"freezing before step {step}", flush=True)
    while True:
        time.sleep(3600)


def main() -> None:
    args = parse()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from verl.utils.logger.aggregate_logger import LocalLogger

    model, optimizer, scheduler, manager, loader = build(rank)
    logger = LocalLogger(print_to_console=rank == 0)
    global_steps = load_checkpoint(args.default_local_dir, args.resume_mode, manager, loader)
    freeze_at = int(os.environ.get("VERL_DRIVER_FREEZE_AT") or 0)
    first_attempt = os.environ.get("RLSUP_RESTART_COUNT", "0") == "0"
    batches = iter(loader)
    while global_steps < args.total_steps:
        global_steps += 1
        if freeze_at and first_attempt and global_steps == freeze_at:
            freeze_here(global_steps)
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            batch = next(batches)
        metrics = train_step(model, optimizer, scheduler, batch, args.step_seconds)
        if args.save_freq > 0 and (global_steps == args.total_steps or global_steps % args.save_freq == 0):
            save_checkpoint(args.default_local_dir, global_steps, manager, loader, rank)
        logger.log(data=metrics, step=global_steps)
    if rank == 0:
        print(f"training done at step {global_steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
