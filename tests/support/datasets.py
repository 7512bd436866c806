"""Datasets tests feed to samplers and loaders."""

from __future__ import annotations

import torch


class Indices(torch.utils.data.Dataset):
    """Item ``i`` is ``i``: a batch says exactly which samples it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i
