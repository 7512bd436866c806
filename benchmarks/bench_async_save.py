"""How long CheckpointManager.save blocks the training loop: async_save=True vs the synchronous save.

    python benchmarks/bench_async_save.py --size-mb 100 --repeat 3 [--device cuda] [--dir /fast/disk]

Prints, per mode, the median time ``save()`` blocked and (async) the time until the step verified on
disk. The first async save also allocates (and with CUDA pins) the snapshot buffer and starts the
writer process; it is reported separately.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from trainer_hooks.checkpoint import CheckpointManager  # noqa: E402
from rlsup_format.manifest import verify_step_dir  # noqa: E402


def make_state(size_mb: int, device: str) -> dict:
    n = size_mb * 1024 * 1024 // 4
    half = n // 2
    return {"model": {"w": torch.randn(half, device=device)}, "optim": {"m": torch.randn(n - half, device=device)},
            "step": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    state = make_state(args.size_mb, args.device)
    med = statistics.median
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        sync = CheckpointManager(root / "sync")
        sync_t = []
        for i in range(args.repeat):
            t0 = time.perf_counter()
            sync.save(i + 1, state)
            sync_t.append(time.perf_counter() - t0)
        mgr = CheckpointManager(root / "async", async_save=True)
        blocked, total = [], []
        first = None
        for i in range(args.repeat + 1):
            t0 = time.perf_counter()
            step_dir = mgr.save(i + 1, state)
            t1 = time.perf_counter()
            state["model"]["w"].add_(1.0)  # training goes on
            mgr.wait()
            t2 = time.perf_counter()
            assert step_dir is not None and verify_step_dir(step_dir, full=False).valid
            if i == 0:
                first = (t1 - t0, t2 - t0)
            else:
                blocked.append(t1 - t0)
                total.append(t2 - t0)
        mgr.close()
    print(f"state: {args.size_mb} MB on {args.device}, median of {args.repeat}")
    print(f"  sync save                  : blocked {med(sync_t) * 1e3:8.1f} ms")
    print(f"  async save                 : blocked {med(blocked) * 1e3:8.1f} ms, "
          f"on disk and verified after {med(total) * 1e3:8.1f} ms  (ratio blocked/sync {med(blocked) / med(sync_t):.3f})")
    assert first is not None
    print(f"  first async save (buffer + writer start): blocked {first[0] * 1e3:.1f} ms, on disk after {first[1] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
