"""Capture and restore one rank's random number generators, so a resumed run draws what it would have.

Why plain lists and ints: checkpoints are loaded with ``torch.load(weights_only=True)``, which only
rebuilds tensors and basic containers. NumPy's state (an ndarray inside a tuple) and Python's state
(a tuple of 625 ints) are therefore stored as lists/ints/floats and turned back on restore.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

log = logging.getLogger(__name__)


def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy (if importable), torch CPU and every visible CUDA device's generator state."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "torch_cpu": torch.get_rng_state(),
    }
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {"kind": str(kind), "keys": [int(k) for k in keys], "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    if torch.cuda.is_available():
        state["torch_cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`; parts absent from ``state`` are left alone."""
    py = state.get("python")
    if py is not None:
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    if "torch_cpu" in state:
        torch.set_rng_state(state["torch_cpu"])
    np_state = state.get("numpy")
    if np_state is not None:
        try:
            import numpy as np
        except ImportError:
            log.warning("checkpoint holds a NumPy RNG state but NumPy is not importable; skipped")
        else:
            np.random.set_state((np_state["kind"], np.asarray(np_state["keys"], dtype=np.uint32),
                                 np_state["pos"], np_state["has_gauss"], np_state["cached_gaussian"]))
    cuda = state.get("torch_cuda")
    if cuda and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if len(cuda) != count:
            log.warning("checkpoint has CUDA RNG states for %d devices, %d visible; restoring %d",
                        len(cuda), count, min(len(cuda), count))
        for device, s in enumerate(cuda[:count]):
            torch.cuda.set_rng_state(s, device)


def reseed_rng(seed: int) -> None:
    """Seed Python, NumPy (if importable; with ``seed`` mod 2**32) and torch (CPU and every CUDA device) from
    one 64-bit ``seed``: the streams of a rank that has no saved ones (:mod:`trainer_hooks.world`)."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)
