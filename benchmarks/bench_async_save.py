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

import torch

from trainer_hooks.checkpoint import CheckpointManager
from rlsup_format.manifest import verify_step_dir


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


def bench_memory_tier(size_mb: int = 1024, repeat: int = 3, shm: str | None = None) -> dict[str, float]:
    """An async save of a ``size_mb`` state into rlsup's memory tier (issue 16 targets: blocked <= 0.15 s,
    valid in memory <= 1.5 s). The tier is a directory in ``shm`` (default /dev/shm when it has room for
    three steps, else a temp dir), set up as ``rlsup run`` does (RLSUP_MEMORY_DIR). Returns the medians in
    seconds over ``repeat`` saves after the first (which starts the writer): ``blocked`` (time in
    ``save()``), ``valid`` (from the call until the step verifies in memory, sizes), and the first save's
    ``first_blocked`` and ``first_valid``."""
    import os

    need = 3 * size_mb << 20
    if shm is None and Path("/dev/shm").is_dir():
        st = os.statvfs("/dev/shm")
        shm = "/dev/shm" if st.f_bavail * st.f_frsize > need else None
    keys = ("RLSUP_CHECKPOINT_DIR", "RLSUP_MEMORY_DIR", "RLSUP_MEMORY_KEEP_LAST")
    saved = {k: os.environ.get(k) for k in keys}
    state = make_state(size_mb, "cpu")
    blocked: list[float] = []
    valid: list[float] = []
    with tempfile.TemporaryDirectory(prefix="rlsup-bench-mem-", dir=shm) as mem, \
            tempfile.TemporaryDirectory(prefix="rlsup-bench-disk-") as disk:
        os.environ.update({"RLSUP_CHECKPOINT_DIR": disk, "RLSUP_MEMORY_DIR": mem, "RLSUP_MEMORY_KEEP_LAST": "1"})
        try:
            mgr = CheckpointManager(keep_last=2, async_save=True)
            for i in range(repeat + 1):
                step_dir = Path(mem) / f"step_{i + 1:09d}"
                t0 = time.perf_counter()
                mgr.save(i + 1, state)
                blocked.append(time.perf_counter() - t0)
                state["model"]["w"].add_(1.0)  # training goes on
                while not verify_step_dir(step_dir, full=False).valid:
                    time.sleep(0.002)
                valid.append(time.perf_counter() - t0)
                mgr.wait()
            mgr.close()
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    med = statistics.median
    return {"blocked": med(blocked[1:]), "valid": med(valid[1:]), "first_blocked": blocked[0],
            "first_valid": valid[0], "size_mb": float(size_mb)}


if __name__ == "__main__":
    if "--memory-tier" in sys.argv:
        sys.argv.remove("--memory-tier")
        print(bench_memory_tier())
    else:
        main()
