"""Time to pick the newest valid checkpoint among 1,000 steps, per layout.

Builds each tree once with the real writers (a single DCP / megatron-core save reused through
hardlinks, so the build is fast and the files are small), breaks the newest step the way a killed
save does, then times ``latest_valid`` (newest-first, stops at the first valid step) and a full
``scan``. AReaL keeps a single recover checkpoint, so it has one step.

    .venv/bin/python benchmarks/bench_selection.py [--steps 1000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import layout_builders as lb  # noqa: E402

from supervisor import layouts  # noqa: E402


def build_verl_fsdp(root: Path, steps: int) -> None:
    tpl = lb.verl_fsdp_step(root, 1)
    for s in range(2, steps + 1):
        lb.copy_tree(tpl, root / f"global_step_{s}")
    lb.write_tracker(root, steps)
    (root / f"global_step_{steps}" / "critic" / "optim_world_size_2_rank_1.pt").unlink()


def build_verl_megatron(root: Path, steps: int) -> None:
    for s in range(1, steps + 1):
        lb.verl_megatron_step(root, s, tracker=False, data_pt=False)
    lb.write_tracker(root, steps)
    (root / f"global_step_{steps}" / "actor" / "ckpt_contents.json").unlink()


def build_megatron(root: Path, steps: int, bridge: bool = False) -> None:
    for s in range(1, steps + 1):
        lb.megatron_iter(root, s, bridge=bridge, tracker=False)
    lb.write_tracker(root, steps)
    (root / f"iter_{steps:07d}" / "metadata.json").unlink()


def build_dcp(root: Path, steps: int) -> None:
    tpl = lb.dcp_template()
    for s in range(1, steps + 1):
        lb.copy_tree(tpl, root / f"step-{s}")
    (root / f"step-{steps}" / ".metadata").unlink()


def build_areal(root: Path, steps: int) -> None:
    lb.areal_recover(root, steps, roles=("default", "critic"))


def build_rlsup(root: Path, steps: int) -> None:
    """One real CheckpointManager save, then every other step as hardlinks plus its own manifest (the
    same files, step number changed): 1,000 real saves with fsyncs take ~25 s for the same tree. The
    newest step then gets a truncated shard, as a save killed mid-write leaves it."""
    import dataclasses

    import torch
    from trainer_hooks.checkpoint import CheckpointManager
    from rlsup_format.manifest import manifest_name, read_manifest, step_dir_name

    tpl = CheckpointManager(directory=root, backend="torch").save(1, {"w": torch.zeros(16)})
    manifest = read_manifest(tpl / manifest_name(0))
    for s in range(2, steps + 1):
        d = root / step_dir_name(s)
        d.mkdir()
        for name in manifest.files:
            os.link(tpl / name, d / name)
        (d / manifest_name(0)).write_text(dataclasses.replace(manifest, step=s).to_json())
    shard = root / step_dir_name(steps) / next(iter(manifest.files))
    data = shard.read_bytes()
    shard.unlink()  # a hardlink: write a new file rather than truncate the shared one
    shard.write_bytes(data[: len(data) // 2])


def trainer_tree(module: str, function: str) -> Callable[[Path, int], None]:
    """A trainer layout's ``bench_tree`` from its test builders (tests/*_builders.py), imported when used."""
    def build(root: Path, steps: int) -> None:
        import importlib

        fn = getattr(importlib.import_module(module), function, None)
        if fn is None:
            raise ImportError(f"{module}.{function} not found")
        fn(root, steps)
    return build


BUILDERS: dict[str, tuple[str, Callable[[Path, int], None]]] = {
    "verl (FSDP)": ("verl", build_verl_fsdp),
    "verl (Megatron v2)": ("verl", build_verl_megatron),
    "Megatron-Core": ("megatron", build_megatron),
    "Megatron-Bridge": ("megatron", lambda r, n: build_megatron(r, n, bridge=True)),
    "torch DCP": ("dcp", build_dcp),
    "AReaL": ("areal", build_areal),
    "rlsup": ("rlsup", build_rlsup),
    "HF Trainer": ("hf", trainer_tree("hf_builders", "bench_tree")),
    "DeepSpeed": ("deepspeed", trainer_tree("deepspeed_builders", "bench_tree")),
    "Lightning": ("lightning", trainer_tree("lightning_builders", "bench_tree")),
    "NeMo 2": ("nemo", trainer_tree("source_builders", "nemo_bench_tree")),
    "NeMo-RL": ("nemo-rl", trainer_tree("source_builders", "nemo_rl_bench_tree")),
    "torchtitan": ("torchtitan", trainer_tree("source_builders", "torchtitan_bench_tree")),
}


def best_of(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="subset of layouts (names as in the table)")
    args = ap.parse_args()
    lb.mcore_dist_template()
    rows = []
    work = Path(tempfile.mkdtemp(prefix="rlsup-bench-"))
    try:
        for label, (layout, build) in BUILDERS.items():
            if args.only and label not in args.only:
                continue
            root = work / label.replace(" ", "_").replace("(", "").replace(")", "")
            root.mkdir()
            t0 = time.perf_counter()
            try:
                build(root, args.steps)
            except ImportError as exc:
                rows.append((label, "-", "-", "-", "-", f"skipped: {exc}"))
                continue
            built = time.perf_counter() - t0
            n = len(layouts.LAYOUTS[layout].list_steps(root))
            t_latest, rec = best_of(lambda: layouts.latest_valid(root, layout), args.repeat)
            t_auto, _ = best_of(lambda: layouts.latest_valid(root), args.repeat)
            t_scan, _ = best_of(lambda: layouts.scan(root, layout), 1)
            picked = f"step {rec.step}" if rec else "none"
            rows.append((label, str(n), f"{built:.1f}", f"{t_latest * 1e3:.1f} / {t_auto * 1e3:.1f}",
                         f"{t_scan * 1e3:.0f}", picked))
            shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    header = ("layout", "steps", "build s", "latest_valid ms (layout / auto)", "full scan ms", "picked")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"megatron-core wrote the MCore dirs: {lb.MCORE_REAL}")
    for r in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
