"""Set-up for tests/thirdparty/test_thirdparty_pykeen_e2e.py: PyKEEN (pykeen/pykeen on GitHub, MIT; ``pip install pykeen``,
pinned in pyproject.toml's ``trainers`` extra), run unmodified through its own console script
``pykeen experiments run CONFIG``, on CPU, offline: only its input, one JSON configuration, is written here.

Why PyKEEN: its training loop keeps one checkpoint file, ``<checkpoint_directory>/<checkpoint_name>``, and
rewrites it in place with ``torch.save(state, path)`` after every epoch (``checkpoint_frequency: 0``;
``pykeen/training/training_loop.py`` ``_save_state``): a kill inside that write leaves the only checkpoint
torn. When the file exists at start it resumes from it by itself (``_load_state``: epoch, model, optimizer and
the Python, NumPy and torch RNG states, so a resumed run should end with an uninterrupted run's weights), and
a torn file makes every restart fail in ``torch.load``. Its dataset, Nations (14 entities, 55 relations, 1,592
training triples), ships inside the wheel: nothing is downloaded. (Ultralytics YOLO, the first candidate, needs
torchvision, and PyPI's torchvision does not import beside this project's CPU build of torch: "operator
torchvision::nms does not exist".)

TransE with 10,000-dimensional embeddings makes ``ckpt.pt`` about 8 MB (model + Adam moments): its save takes
long enough to be cut, and an epoch (13 batches of 128) takes a second or two on 2 loaded cores, more than
rlsup's 0.5 s pass over single-file checkpoints.

Run as a script it writes the configuration into a directory: ``python tests/thirdparty/setup_pykeen.py DIR``,
then ``cd DIR && PYKEEN_HOME=$PWD/pykeen-home pykeen experiments run pykeen.json -d out --keep-seed -v``.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

EPOCHS = 12
CKPT_DIR, CKPT_NAME = "ckpts", "ckpt.pt"
CONFIG = "pykeen.json"
# the trainer's launch line (its console script), and rlsup's flags for it (README: single-file checkpoints)
LAUNCH = ["pykeen", "experiments", "run", CONFIG, "--directory", "out", "--keep-seed", "-v"]
SAVED_RE = r"=> Saved checkpoint after having finished epoch (\d+)\."
RESUMED_RE = r"=> loaded checkpoint '[^']*' stopped after having finished epoch (\d+)"
FRESH_LINE = "=> no checkpoint found at"
RLSUP = ["--checkpoint-dir", CKPT_DIR, "--checkpoint-layout", "single-file", "--checkpoint-file", CKPT_NAME,
         "--progress-regex", r"Saved checkpoint after having finished epoch (\d+)"]


def config(epochs: int = EPOCHS) -> dict:
    """The ``pykeen experiments run`` configuration (``metadata`` + ``pipeline``: pykeen.pipeline.pipeline's
    arguments). ``checkpoint_frequency: 0`` saves after every epoch; ``random_seed`` is kept (``--keep-seed``)."""
    return {
        "metadata": {"title": "rlsup: TransE on Nations, one checkpoint file rewritten every epoch"},
        "pipeline": {
            "dataset": "nations",
            "model": "TransE",
            "model_kwargs": {"embedding_dim": 10000},
            "optimizer": "Adam",
            "optimizer_kwargs": {"lr": 0.01},
            "training_loop": "slcwa",
            "training_kwargs": {"num_epochs": epochs, "batch_size": 128, "checkpoint_name": CKPT_NAME,
                                "checkpoint_directory": CKPT_DIR, "checkpoint_frequency": 0},
            "random_seed": 1,
            "device": "cpu",
        },
    }


def workdir(dest: Path, epochs: int = EPOCHS) -> Path:
    """``dest`` with the configuration; ``env(dest)`` keeps PyKEEN's dataset cache inside it."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / CONFIG).write_text(json.dumps(config(epochs), indent=1) + "\n")
    return dest


def env(dest: Path) -> dict[str, str]:
    """Environment for the trainer: PyKEEN's home (pystow: dataset cache) in the run's directory, not ~."""
    return {"PYKEEN_HOME": str(dest / "pykeen-home")}


def ckpt_state(data: bytes) -> dict | None:
    """A ``ckpt.pt``'s contents, or None when its bytes do not load (torn)."""
    import torch

    try:
        return torch.load(io.BytesIO(data), weights_only=False, map_location="cpu")
    except Exception:  # a torn zip raises any of several errors
        return None


def ckpt_epoch(data: bytes) -> int | None:
    state = ckpt_state(data)
    return None if state is None else int(state["epoch"])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: setup_pykeen.py DIR")
    print(workdir(Path(sys.argv[1])))
