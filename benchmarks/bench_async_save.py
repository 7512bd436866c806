"""How long CheckpointManager.save blocks the training loop: async_save=True vs the synchronous save.

    python benchmarks/bench_async_save.py --size-mb 100 --repeat 3 [--device cuda] [--dir /fast/disk]

Prints, per mode, the median time ``save()`` blocked and (async) the time until the step verified on
disk. The first async save also allocates (and with CUDA pins) the snapshot buffer and may wait for the
writer process, started with the manager, to finish its start-up; it is reported separately.
"""

from __future__ import annotations

import argparse
import contextlib
import os
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
    print(f"  first async save (buffer; the writer started with the manager): blocked {first[0] * 1e3:.1f} ms, on disk after {first[1] * 1e3:.0f} ms")


def _tier_dir(size_mb: int, shm: str | None) -> str | None:
    """/dev/shm when it has room for both sides' steps and spares, else None (a temp dir on disk)."""
    if shm is None and Path("/dev/shm").is_dir():
        st = os.statvfs("/dev/shm")
        shm = "/dev/shm" if st.f_bavail * st.f_frsize > 6 * size_mb << 20 else None
    return shm


def bench_memory_tier(size_mb: int = 1024, repeat: int = 5, shm: str | None = None, step_s: float = 1.0,
                      sides: tuple[str, ...] = ("direct", "classic")) -> dict[str, dict[str, float]]:
    """An async save of a ``size_mb`` state into rlsup's memory tier (issue 31 target: valid in memory
    <= 1 s after the call; issue 16: blocked <= 0.15 s), one manager per side, saves alternating between
    the sides. ``direct``: the snapshot copied straight into the step file (:mod:`trainer_hooks.direct_save`);
    ``classic``: ``CheckpointManager(direct_save=False)``, the snapshot into a buffer, then ``torch.save`` into the tier.
    Each side's tier is a directory in ``shm`` (default /dev/shm when it has room), set up as ``rlsup run``
    does (RLSUP_MEMORY_DIR, keep 1 step). After each save, ``step_s`` of "training" (a sleep: the compute of
    a GPU job) before the next. Returns per side the medians in seconds over ``repeat`` saves after the
    first (which allocates the buffer and may wait for the writer's start-up): ``blocked`` (time in ``save()``), ``valid`` (from the call until the
    step verifies in memory, sizes), ``writer`` (the writer's own time for the request, from its receipt
    to the manifest), the first save's ``first_blocked`` and ``first_valid``, and ``direct_saves`` (how
    many of the timed saves went direct)."""
    shm = _tier_dir(size_mb, shm)
    keys = ("RLSUP_CHECKPOINT_DIR", "RLSUP_MEMORY_DIR", "RLSUP_MEMORY_KEEP_LAST")
    saved = {k: os.environ.get(k) for k in keys}
    state = make_state(size_mb, "cpu")
    times: dict[str, dict[str, list[float]]] = {side: {"blocked": [], "valid": [], "direct": [], "writer": []}
                                                   for side in sides}
    with contextlib.ExitStack() as stack:
        env, mgrs = {}, {}
        for side in sides:
            mem = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"rlsup-bench-mem-{side}-", dir=shm))
            disk = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"rlsup-bench-disk-{side}-"))
            env[side] = {"RLSUP_CHECKPOINT_DIR": disk, "RLSUP_MEMORY_DIR": mem, "RLSUP_MEMORY_KEEP_LAST": "1"}
            os.environ.update(env[side])
            mgrs[side] = CheckpointManager(keep_last=2, async_save=True, direct_save=side == "direct")
        try:
            for i in range(repeat + 1):
                for side in sides if i % 2 == 0 else tuple(reversed(sides)):
                    os.environ.update(env[side])
                    step_dir = Path(env[side]["RLSUP_MEMORY_DIR"]) / f"step_{i + 1:09d}"
                    t0 = time.perf_counter()
                    mgrs[side].save(i + 1, state)
                    times[side]["blocked"].append(time.perf_counter() - t0)
                    state["model"]["w"].add_(1.0)  # training goes on
                    while not verify_step_dir(step_dir, full=False).valid:
                        time.sleep(0.002)
                    times[side]["valid"].append(time.perf_counter() - t0)
                    mgrs[side].wait()
                    result = mgrs[side]._async.completed[-1].result
                    times[side]["direct"].append(float(bool(result.get("direct"))))
                    times[side]["writer"].append(float(result.get("seconds", 0.0)))
                    time.sleep(step_s)
        finally:
            for mgr in mgrs.values():
                mgr.close()
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    med = statistics.median
    return {side: {"blocked": med(t["blocked"][1:]), "valid": med(t["valid"][1:]), "first_blocked": t["blocked"][0],
                   "first_valid": t["valid"][0], "direct_saves": sum(t["direct"][1:]),
                   "writer": med(t["writer"][1:]), "all_writer": t["writer"],
                   "all_valid": t["valid"], "all_blocked": t["blocked"], "size_mb": float(size_mb)}
            for side, t in times.items()}


if __name__ == "__main__":
    if "--memory-tier" in sys.argv:
        sys.argv.remove("--memory-tier")
        reps = int(sys.argv[sys.argv.index("--repeat") + 1]) if "--repeat" in sys.argv else 5
        print(os.getloadavg())
        for side, r in bench_memory_tier(repeat=reps).items():
            print(side, {k: [round(x, 3) for x in v] if isinstance(v, list) else round(v, 3) for k, v in r.items()})
        print(os.getloadavg())
    else:
        main()
