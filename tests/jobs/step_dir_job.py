"""A trainer of litgpt's shape: ``torch.save`` of its state into a new ``OUT/step-{iter:08d}/lit_model.pth`` every
``--save-every`` iterations, and ``--resume auto`` that picks the newest ``step-*/*.pth`` itself, by the number in
the directory's name, as litgpt's ``find_resume_path`` does (a torn newest one is loaded, and the load fails).
Prints ``iter N`` lines and ``resumed from PATH at iter N``.

usage: step_dir_job.py OUT --iters N --save-every K [--resume auto|PATH|none]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def find_resume_path(resume: str, out: Path) -> Path | None:
    if resume == "none":
        return None
    if resume != "auto":
        return Path(resume)
    return max(out.rglob("step-*/*.pth"), key=lambda p: int(p.parent.name.split("-")[1]), default=None)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--resume", default="auto")
    args = p.parse_args()
    weights, start = torch.zeros(8), 0
    path = find_resume_path(args.resume, args.out)
    if path is not None:
        state = torch.load(path, weights_only=True)  # a torn file raises here, as litgpt's fabric.load does
        weights, start = state["model"], state["iter_num"]
        print(f"resumed from {path} at iter {start}", flush=True)
    for it in range(start + 1, args.iters + 1):
        weights = weights + 1
        print(f"iter {it}", flush=True)
        if it % args.save_every == 0:
            target = args.out / f"step-{it:08d}" / "lit_model.pth"
            target.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": weights, "iter_num": it}, target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
