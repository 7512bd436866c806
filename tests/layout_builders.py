"""Build checkpoint trees the way verl, Megatron-Core/Bridge and AReaL write them, with the real
writers (``torch.save``, ``torch.distributed.checkpoint.save``, megatron-core
``dist_checkpointing.save``), then break them the way a killed save does.

Megatron-core needs a process group and CUDA entry points even for a CPU save: :func:`mcore_cpu_env`
provides a one-rank gloo group (file store, no network) and shims ``torch.cuda.synchronize`` /
``torch.cuda.current_device`` only for the duration of the save. When megatron-core is not
installed, :func:`mcore_dist_template` falls back to a DCP save plus the ``common.pt`` and
``metadata.json`` files MCore writes (``MCORE_REAL`` tells which was used).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import tempfile
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import torch

MCORE_REAL: bool | None = None  # set by mcore_dist_template: True when megatron-core wrote it
_TEMPLATE: Path | None = None
_DCP_TEMPLATE: Path | None = None


def tiny_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 8, generator=g), "b": torch.randn(8, generator=g), "step": seed}


def dcp_save(directory: Path, seed: int = 0) -> Path:
    """A real single-process torch DCP save."""
    import torch.distributed.checkpoint as dcp

    directory.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(tiny_state(seed), checkpoint_id=str(directory))
    return directory


def dcp_template() -> Path:
    """One DCP save reused (copied) by builders that need many."""
    global _DCP_TEMPLATE
    if _DCP_TEMPLATE is None:
        _DCP_TEMPLATE = dcp_save(Path(tempfile.mkdtemp(prefix="rlsup-dcp-tpl-")) / "dcp")
    return _DCP_TEMPLATE


def init_one_rank_gloo() -> None:
    """An in-process one-rank gloo group on an in-memory store, 60 s timeouts: a file store's C++ wait is
    out of pytest-timeout's reach (SIGALRM), and a store passed in keeps its own 300 s otherwise."""
    import torch.distributed as dist

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))


@contextlib.contextmanager
def mcore_cpu_env() -> Iterator[None]:
    """One-rank gloo group plus CUDA shims, undone on exit."""
    import torch.distributed as dist

    saved = (torch.cuda.synchronize, torch.cuda.current_device)
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    created = False
    try:
        if not dist.is_initialized():
            init_one_rank_gloo()
            created = True
        yield
    finally:
        if created:
            dist.destroy_process_group()
        torch.cuda.synchronize, torch.cuda.current_device = saved  # type: ignore[assignment]


def mcore_save(directory: Path, seed: int = 0) -> Path:
    """A real megatron-core torch_dist save (synchronous) of a tiny sharded state dict."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import ShardedTensor

        directory.mkdir(parents=True, exist_ok=True)
        state = tiny_state(seed)
        sharded = {
            "w": ShardedTensor.from_rank_offsets("w", state["w"], replica_id=0),
            "b": ShardedTensor.from_rank_offsets("b", state["b"], replica_id=0),
            "iteration": seed,
        }
        with mcore_cpu_env():
            dist_checkpointing.save(sharded, str(directory))
    return directory


def _fake_mcore(directory: Path, seed: int = 0) -> Path:
    dcp_save(directory, seed)
    torch.save({"iteration": seed}, directory / "common.pt")
    (directory / "metadata.json").write_text(
        json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                    "common_backend": "torch", "common_backend_version": 1})
    )
    return directory


def mcore_dist_template() -> Path:
    """One MCore dist checkpoint, saved once per test session and copied into every tree."""
    global _TEMPLATE, MCORE_REAL
    if _TEMPLATE is None:
        from support.template_cache import cached, version_of

        def build(into: Path) -> None:
            try:
                mcore_save(into / "dist")
                (into / "real").write_text("")
            except ImportError:
                shutil.rmtree(into / "dist", ignore_errors=True)
                _fake_mcore(into / "dist")

        # kept between runs (support.template_cache): the real save imports megatron-core and costs seconds
        saved = cached(f"mcore-dist_{version_of('megatron-core', 'torch')}", build)
        MCORE_REAL, _TEMPLATE = (saved / "real").is_file(), saved / "dist"
    return _TEMPLATE


def copy_tree(src: Path, dst: Path) -> Path:
    """Hardlink when possible (fast, the benchmark's 1,000 steps), copy otherwise."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copytree(src, dst, copy_function=os.link)
    except OSError:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
    return dst


def write_tracker(root: Path, step: int | str) -> Path:
    """Like verl/Megatron: a plain open('w')."""
    path = root / "latest_checkpointed_iteration.txt"
    with open(path, "w") as fh:
        fh.write(str(step))
    return path


# ---------------------------------------------------------------- verl

def verl_fsdp_step(root: Path, step: int, world: int = 2, roles: tuple[str, ...] = ("actor", "critic"),
                   data_pt: bool = True, tracker: bool = True, dirname: str = "global_step_{}") -> Path:
    step_dir = root / dirname.format(step)
    for role in roles:
        d = step_dir / role
        d.mkdir(parents=True, exist_ok=True)
        for r in range(world):
            st = tiny_state(step * 100 + r)
            torch.save({"w": st["w"]}, d / f"model_world_size_{world}_rank_{r}.pt")
            torch.save({"state": {0: {"exp_avg": st["b"]}}}, d / f"optim_world_size_{world}_rank_{r}.pt")
            torch.save({"lr_scheduler": {"last_epoch": step}, "rng": torch.get_rng_state()},
                       d / f"extra_state_world_size_{world}_rank_{r}.pt")
        (d / "huggingface").mkdir(exist_ok=True)
        (d / "huggingface" / "config.json").write_text("{}")
        (d / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
    if data_pt:
        torch.save({"dataloader": {"samples_yielded": step}}, step_dir / "data.pt")
    if tracker:
        write_tracker(root, step)
    return step_dir


def verl_megatron_step(root: Path, step: int, roles: tuple[str, ...] = ("actor", "critic"),
                       manifest: bool = True, tracker: bool = True, data_pt: bool = True) -> Path:
    """Layout v2: model/, optimizer/, extra/ dist_ckpt dirs, transformer_config.json, manifest last."""
    step_dir = root / f"global_step_{step}"
    tpl = mcore_dist_template()
    for role in roles:
        d = step_dir / role
        for rel in ("model/dist_ckpt", "optimizer/dist_ckpt", "extra/dist_ckpt"):
            copy_tree(tpl, d / rel)
        (d / "transformer_config.json").write_text(json.dumps({"num_layers": 2}))
        if manifest:
            contents = {
                "model": {"path": "model/dist_ckpt", "format": "megatron_dist_checkpoint"},
                "optimizer": {"path": "optimizer/dist_ckpt", "format": "megatron_dist_checkpoint"},
                "lr_scheduler": {"path": "optimizer/dist_ckpt", "format": "megatron_dist_checkpoint", "key": "lr_scheduler"},
                "rng_state": {"path": "extra/dist_ckpt", "format": "megatron_dist_checkpoint", "key": "rng_state"},
                "transformer_config": {"path": "transformer_config.json", "format": "json"},
            }
            (d / "ckpt_contents.json").write_text(json.dumps({
                "schema_version": 2, "framework": "megatron", "role": role, "global_step": step, "world_size": 1,
                "backend": {"has_bridge": False, "use_dist_checkpointing": True, "peft": False},
                "save_contents": ["model", "optimizer", "extra"], "contents": contents,
                "directories": {"model/dist_ckpt": "", "optimizer/dist_ckpt": "", "extra/dist_ckpt": ""},
                "saved_any_dist_ckpt": True,
            }))
    if data_pt:
        torch.save({"dataloader": {"samples_yielded": step}}, step_dir / "data.pt")
    if tracker:
        write_tracker(root, step)
    return step_dir


def verl_legacy_step(root: Path, step: int) -> Path:
    """Pre-v2: a role-level dist_ckpt/ and huggingface/."""
    step_dir = root / f"global_step_{step}"
    copy_tree(mcore_dist_template(), step_dir / "actor" / "dist_ckpt")
    (step_dir / "actor" / "huggingface").mkdir(parents=True)
    write_tracker(root, step)
    return step_dir


# ---------------------------------------------------------------- Megatron-Core / Bridge

def megatron_iter(root: Path, step: int, bridge: bool = False, tracker: bool = True) -> Path:
    it = copy_tree(mcore_dist_template(), root / f"iter_{step:07d}")
    if bridge:
        state = {"step": torch.tensor(step), "consumed_train_samples": torch.tensor(step * 8)}
        torch.save(state, it / "train_state.pt")
        shutil.copy(it / "train_state.pt", root / "latest_train_state.pt")
    if tracker:
        write_tracker(root, step)
    if bridge:
        (it / "run_config.yaml").write_text(f"train:\n  train_iters: {step}\n")
    return it


# ---------------------------------------------------------------- AReaL

def areal_recover(root: Path, step: int, roles: tuple[str, ...] = ("default",), seed: int | None = None) -> Path:
    """Engine DCP save into <role>/recover_checkpoint (overwriting), then recover_info/ last."""
    for role in roles:
        ckpt = root / role / "recover_checkpoint"
        dcp_save(ckpt, step if seed is None else seed)
    areal_info(root, step)
    return root


def areal_info(root: Path, step: int) -> None:
    info = root / "recover_info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "step_info.json").write_text(json.dumps(
        {"epoch": 0, "epoch_step": step, "global_step": step, "steps_per_epoch": 1000}))
    for name in ("saver_info.json", "evaluator_info.json", "stats_logger_info.json", "checkpoint_info.json"):
        (info / name).write_text(json.dumps({"step": step}))
    with open(info / "dataloader_info.pkl", "wb") as fh:
        pickle.dump({"samples": step}, fh)


# ---------------------------------------------------------------- damage

def truncate(path: Path, keep: float = 0.5) -> Path:
    """Cut a file short, as a writer killed mid-write leaves it. Rewrites a fresh inode so a
    hardlinked template shared with other trees stays intact."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def largest(directory: Path, pattern: str) -> Path:
    return max(directory.glob(pattern), key=lambda p: p.stat().st_size)
