"""One phase of a run that changes world size: torchrun (gloo, CPU) trains a tiny model with DDP or FSDP2 until
``--until``, saving at ``--save-at`` steps through CheckpointManager, after restoring the newest step (saved by
any world size). The global batch (GLOBAL) is kept by gradient accumulation (trainer_hooks.grad_accum_steps).

Each rank appends one line per micro batch to ``<log-dir>/ids.<tag>.rank<R>``: ``step epoch id id ...``; rank 0
prints ``WORLD_CHANGE step saved new`` after a restore from another world, and writes the final full weights to
``--out``. Used by tests/trainer_hooks/test_world_change_e2e.py.

Under rlsup on several nodes (tests/cluster/test_shrink_e2e.py): ``--attempt-tag`` adds the attempt
(``RLSUP_RESTART_COUNT``) to the tag, so the test tells the ids an attempt that was killed wrote from the ids of the
attempt that redid those steps; ``--hold-at STEP --hold-file PATH`` makes rank 0 of the first attempt wait after
step STEP (and its save) until PATH exists, so the test loses a node at a known step (the other ranks wait in the
next collective); ``--hold-in WORLD:STEP:PATH`` (repeatable) does the same in any attempt of WORLD ranks (the shrunk job, held
until the lost node is back); ``--not-resizable`` saves with ``CheckpointManager(resizable=False)``, as a trainer that never
marks its saves restorable into another world size. None of them changes what is computed."""
import argparse
import contextlib
import gc
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import trainer_hooks
from trainer_hooks import CheckpointManager, ResumableSampler, grad_accum_steps

N, GLOBAL, MICRO, FEATURES = 60, 12, 2, 4


class Samples(Dataset):
    """Sample ``i`` is (i, x_i, y_i), fixed by a seed: the test reads the ids back from the logs."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(123)
        self.x = torch.randn(N, FEATURES, generator=g)
        self.y = self.x @ torch.randn(FEATURES, 1, generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


def build(kind: str) -> tuple[nn.Module, nn.Module]:
    """(the module the loop calls, the module saved): DDP and its wrapper, or FSDP2 (the same module)."""
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))
    if kind == "ddp":
        net = nn.parallel.DistributedDataParallel(model)
        return net, net
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, model


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor as a whole (a collective for a DTensor: every rank calls it)."""
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().clone()


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k.removeprefix("module."): whole(v) for k, v in model.state_dict().items()}


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Weights and optimizer state, whole, under flat names: what a save holds, in any world."""
    out = {f"model/{k}": v for k, v in full_weights(model).items()}
    for index, values in sorted(optimizer.state_dict()["state"].items()):
        out.update({f"optim/{index}/{k}": whole(v) for k, v in sorted(values.items())})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["ddp", "fsdp"], required=True)
    p.add_argument("--backend", choices=["torch", "dcp"], required=True)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--until", type=int, required=True)
    p.add_argument("--save-at", default="", help="Comma-separated steps to save at.")
    p.add_argument("--log-dir", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--out", default=None)
    p.add_argument("--dump-dir", default=None, help="Rank 0 writes the whole state after each save and restore.")
    p.add_argument("--attempt-tag", action="store_true", help="Tag the id logs with the attempt too.")
    p.add_argument("--hold-at", type=int, default=None, help="Attempt 0's rank 0 waits after this step ...")
    p.add_argument("--hold-file", default=None, help="... until this file exists.")
    p.add_argument("--hold-in", action="append", default=[],
                   help="WORLD:STEP:PATH: rank 0 of a WORLD-rank attempt waits after STEP (repeatable).")
    p.add_argument("--not-resizable", action="store_true", help="CheckpointManager(resizable=False).")
    args = p.parse_args()
    save_at = {int(s) for s in args.save_at.split(",") if s}
    attempt = os.environ.get("RLSUP_RESTART_COUNT") or "0"
    tag = f"{args.tag}.attempt{attempt}" if args.attempt_tag else args.tag
    hold_at = args.hold_at if attempt == "0" and args.hold_file else None
    holds = {}  # (world, step) -> the file rank 0 waits for
    for spec in args.hold_in:
        w, s, path = spec.split(":", 2)
        holds[(int(w), int(s))] = path
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    net, saved = build(args.model)
    optimizer = torch.optim.AdamW(saved.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
    sampler = ResumableSampler(N, shuffle=True, seed=7)
    loader = DataLoader(Samples(), batch_size=MICRO, sampler=sampler, num_workers=0, generator=torch.Generator())
    ckpt = CheckpointManager(args.checkpoint_dir, backend=args.backend, resizable=False if args.not_resizable else None)
    state = {"model": saved, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
    gc.freeze()  # as examples/train_tiny.py: what lives as long as the run, out of the collector's way
    step = ckpt.restore(state)
    change = ckpt.world_change
    if rank == 0 and change is not None:
        print(f"WORLD_CHANGE {change.step} {change.saved_world_size} {change.world_size}", flush=True)

    def dump(what: str) -> None:
        whole_state = full_state(saved, optimizer)
        if rank == 0 and args.dump_dir:
            torch.save(whole_state, Path(args.dump_dir) / f"{what}.step{step}.world{world}.pt")

    if step:
        dump("restored")
    if args.model == "ddp":
        trainer_hooks.prime_ddp(net, torch.zeros(MICRO, FEATURES))
    accum = grad_accum_steps(GLOBAL, MICRO, world)

    def batches():
        while True:
            for batch in loader:
                yield sampler.epoch, batch
            sampler.set_epoch(sampler.epoch + 1)

    stream = batches()
    with open(Path(args.log_dir) / f"ids.{tag}.rank{rank}", "a") as log:
        while step < args.until:
            optimizer.zero_grad()
            for i in range(accum):
                epoch, (ids, x, y) = next(stream)
                last = i == accum - 1
                if args.model == "ddp":
                    sync = contextlib.nullcontext() if last else net.no_sync()
                else:
                    net.set_requires_gradient_sync(last)
                    sync = contextlib.nullcontext()
                with sync:
                    loss = nn.functional.mse_loss(net(x), y) / accum
                    loss.backward()
                log.write(f"{step + 1} {epoch} {' '.join(str(int(t)) for t in ids)}\n")
            optimizer.step()
            scheduler.step()
            step += 1
            if step in save_at:
                log.flush()
                ckpt.save(step, state)
                dump("saved")
            if step == hold_at and rank == 0:
                log.flush()
                print(f"HOLDING after step {step}", flush=True)
                while not Path(args.hold_file).exists():
                    time.sleep(0.05)
            held_file = holds.get((world, step))
            if held_file is not None and rank == 0 and not Path(held_file).exists():
                log.flush()
                print(f"HOLDING in world {world} after step {step}", flush=True)
                while not Path(held_file).exists():
                    time.sleep(0.05)
    weights = full_weights(saved)
    if rank == 0 and args.out:
        torch.save(weights, args.out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    # Once main's locals (DDP's reducer) are gone, as examples/train_tiny.py explains.
    dist.destroy_process_group()
