"""Record real GPU error outputs for tests/data/gpu_errors/ (README.md there): run on a CUDA machine,
``python3 tests/data/gpu_errors/record.py OUTDIR``; each case's combined output goes to ``OUTDIR/<case>.out``
and, under torchrun, torchelastic's error file to ``OUTDIR/<case>.error.json``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "worker.py")
CASES = {
    "cuda_oom": [sys.executable, WORKER, "oom"],
    "cuda_device_assert": [sys.executable, WORKER, "assert"],
    "torchrun_cuda_oom": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                          WORKER, "oom"],
    "torchrun_nccl_duplicate_gpu": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    "--nproc-per-node", "2", WORKER, "nccl_dup"],
}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, argv in CASES.items():
        env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(out / f"{name}.error.json")}
        try:
            r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=150)
            text, code = r.stdout + r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            text, code = f"{e.stdout or ''}{e.stderr or ''}", "timeout"
        (out / f"{name}.out").write_text(text if isinstance(text, str) else text.decode(errors="replace"))
        print(f"{name}: exit {code}", flush=True)
    import torch

    versions = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip()
    (out / "versions.txt").write_text(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
                                      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, {versions}\n")


if __name__ == "__main__":
    main()
