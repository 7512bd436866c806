"""Default backend: one ``torch.save`` file per rank (``rank_00003.pt``), loaded with weights_only=True.

Simple and fast for replicated (DDP) or small models; each rank reloads exactly what it saved. After a
world change every rank loads rank 0's file, which holds the whole (replicated) state; sharded state
needs the ``dcp`` backend (:mod:`trainer_hooks.world` decides which saves may move).
"""

from __future__ import annotations

from typing import Any

import torch

from trainer_hooks.backends.base import LoadContext, SaveContext, safe_load


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


class TorchBackend:
    name = "torch"
    collective = False

    def save(self, ctx: SaveContext, payload: dict[str, Any]) -> None:
        with ctx.new_file(shard_name(ctx.rank)) as f:  # hashed as torch writes it
            torch.save(payload, f)

    def load(self, ctx: LoadContext) -> dict[str, Any]:
        return safe_load(ctx.step_dir / shard_name(ctx.part_rank), ctx.safe_globals)
