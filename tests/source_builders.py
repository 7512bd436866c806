"""NeMo 2, NeMo-RL and torchtitan checkpoint trees, built by doing what each trainer's save does, file by file.

These trainers cannot run here (NeMo needs its GPU stack, torchtitan is not installed), so each builder
re-enacts the trainer's save from its source, in the same order, with the real tensor writers where the
source uses them: megatron-core ``dist_checkpointing.save`` (NeMo 2's ``weights/``),
``torch.distributed.checkpoint.save`` (NeMo-RL's DTensor policy, torchtitan), ``torch.save``
(NeMo-RL's dataloader state) and torch's ``HuggingFaceStorageWriter`` (torchtitan's HF export).
Each builder's docstring names the repository, file and commit it follows.

Stopping a save after its k-th file operation (:class:`FileOps`): an audit hook counts file operations
under the tree with the same rules as ``tests/kill_matrix.py`` (open for writing, rename, mkdir,
remove, rmtree, symlink, torch.save announced as an open) and raises :class:`KillPoint` just before
the k-th and before every one after it, so nothing more reaches the disk: the prefix a SIGKILL
there leaves (buffered bytes of a file already open may still be flushed; the half-written variants
in the tests cover torn files). ``python tests/source_builders.py LAYOUT ROOT STEP...`` runs a
builder as a process, for :mod:`kill_matrix` to SIGKILL for real; the tests check both agree.

Each layout's trainer-side "latest" logic is reimplemented from source too
(:func:`nemo_autoresume_pick`, :func:`nemo_rl_latest`, :func:`torchtitan_find_load_step`), and
``*_bench_tree(root, steps)`` builds many steps cheaply (hardlinks of one real save) with the newest
one broken the way a killed save leaves it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import layout_builders as lb

NEMO_SRC = ("NVIDIA/NeMo", "nemo/lightning/pytorch/callbacks/model_checkpoint.py, nemo/lightning/io/pl.py, "
            "nemo/lightning/io/mixin.py, nemo/lightning/resume.py", "8cfedd7203462cb251a914e700e5605444277561")
NEMO_RL_SRC = ("NVIDIA-NeMo/RL", "nemo_rl/utils/checkpoint.py, nemo_rl/utils/native_checkpoint.py, "
               "nemo_rl/algorithms/grpo.py", "01e9028b7fd77ef5aca3e970cac250dea0bb6f2c")
TORCHTITAN_SRC = ("pytorch/torchtitan", "torchtitan/components/checkpointer/dcp.py",
                  "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a")

# ---------------------------------------------------------------- stopping a save after k file operations

_AUDITED = ("open", "os.rename", "os.replace", "os.symlink", "os.link", "os.remove", "os.rmdir", "os.mkdir",
            "shutil.rmtree", "os.truncate")
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class KillPoint(BaseException):
    """Raised by the audit hook in place of the k-th file operation (a SIGKILL stand-in)."""


@dataclass
class FileOps:
    """Counts file operations under ``root`` (kill_matrix's rules); ``stop_at`` k refuses the k-th onwards."""

    root: Path
    stop_at: int | None = None
    events: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    killed: bool = False

    def paths_of(self, event: str, args: tuple) -> tuple:
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or path is None:
                return ()
            if isinstance(mode, str) and any(c in mode for c in "wax+"):
                return (path,)
            return (path,) if isinstance(flags, int) and flags & _WRITING else ()
        if event in ("os.rename", "os.replace", "os.symlink", "os.link"):
            return (args[0], args[1])
        return (args[0],)

    def see(self, event: str, args: tuple) -> None:
        names = [os.path.abspath(os.fsdecode(p)) for p in self.paths_of(event, args) if not isinstance(p, int)]
        root = str(self.root)
        if not any(n == root or n.startswith(root + os.sep) for n in names):
            return
        self.events.append((event, tuple(names)))
        if self.stop_at is not None and len(self.events) >= self.stop_at:
            self.killed = True
            raise KillPoint(f"stopped before file operation #{len(self.events)}: {event} {names}")


_ACTIVE: list[FileOps] = []


def _hook(event: str, args: tuple) -> None:
    if _ACTIVE and event in _AUDITED:
        ops = _ACTIVE[-1]
        _ACTIVE.append(ops)  # re-entrancy guard: os.path calls below never audit, but be safe
        try:
            ops.see(event, args)
        finally:
            _ACTIVE.pop()


sys.addaudithook(_hook)


@contextlib.contextmanager
def _announce_torch_save() -> Iterator[None]:
    """torch.save opens its zip in C++ (no audit event): announce it, as kill_matrix's hook does."""
    import torch.serialization as ser

    original = ser._open_zipfile_writer

    def announced(name_or_buffer: Any) -> Any:
        if isinstance(name_or_buffer, (str, bytes, os.PathLike)):
            sys.audit("open", os.fspath(name_or_buffer), "wb", 0)
        return original(name_or_buffer)

    ser._open_zipfile_writer = announced
    try:
        yield
    finally:
        ser._open_zipfile_writer = original


def run_ops(root: Path, action: Callable[[], Any], stop_at: int | None = None) -> FileOps:
    """Run ``action`` counting its file operations under ``root``; stop before the ``stop_at``-th."""
    ops = FileOps(Path(os.path.abspath(root)), stop_at)
    _ACTIVE.append(ops)
    try:
        with _announce_torch_save(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            action()
    except BaseException:  # DCP wraps the KillPoint in CheckpointException, itself a BaseException
        if not ops.killed:
            raise
    finally:
        _ACTIVE.remove(ops)
    return ops


def rel_events(ops: FileOps) -> list[tuple[str, tuple[str, ...]]]:
    """Events with paths relative to the tree root (comparable across copies of a tree)."""
    root = str(ops.root)
    return [(e, tuple(os.path.relpath(p, root) for p in paths)) for e, paths in ops.events]


def index_of(events: list[tuple[str, tuple[str, ...]]], event: str, suffix: str) -> int:
    """1-based index of the first ``event`` whose first path ends with ``suffix``."""
    for i, (e, paths) in enumerate(events, 1):
        if e == event and paths[0].endswith(suffix):
            return i
    raise LookupError(f"no {event} on *{suffix}")


def prefix_trees(base: Path, work: Path, action: Callable[[Path], Any],
                 ks: list[int] | None = None) -> Iterator[tuple[int, Path, list[tuple[str, tuple[str, ...]]]]]:
    """The kill matrix: ``action`` run once on a copy of ``base`` to count its file operations, then, for
    every k (or those in ``ks``), on a fresh copy stopped before its k-th: yields (k, tree, all events)."""
    probe = lb.copy_tree(base, work / "full")
    events = rel_events(run_ops(probe, lambda: action(probe)))
    for k in ks or range(1, len(events) + 1):
        root = lb.copy_tree(base, work / f"k{k:03d}")
        run_ops(root, lambda: action(root), stop_at=k)
        yield k, root, events


def tree_names(root: Path) -> list[str]:
    """Every path under ``root``, relative, sorted (to compare what two kills left)."""
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, ds, fs in os.walk(root) for n in ds + fs)


# ---------------------------------------------------------------- NeMo 2

NEMO_MARKER = "-unfinished"


def nemo_name(step: int, last: bool = False, model: str = "megatron_gpt") -> str:
    """NeMo 2's default ``{model_name}--{val_loss:.2f}-{step}-{consumed_samples}`` (+ ``-last``)."""
    return f"{model}--val_loss={1.0 + 1.0 / (step + 1):.2f}-step={step}-consumed_samples={8.0 * step}" + (
        "-last" if last else "")


def nemo_marker(ckpt: Path) -> Path:
    """``ModelCheckpoint.format_checkpoint_unfinished_marker_path``: the path minus .ckpt/-EMA, + -unfinished."""
    return Path(str(ckpt).removesuffix(".ckpt").removesuffix("-EMA") + NEMO_MARKER)


def _nemo_io_dump(ckpt: Path, step: int) -> None:
    """``IOMixin.io_dump(ckpt/"context", yaml_attrs=["model"])``: mkdir, io.json opened, artifacts copied
    while it is open, JSON written, then model.yaml."""
    out = ckpt / "context"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "io.json", "w") as f:
        (out / "nemo_tokenizer").mkdir(parents=True, exist_ok=True)
        (out / "nemo_tokenizer" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
        f.write(json.dumps({"root": {"type": "ref", "key": "trainer_context_1"},
                            "objects": {"model": {"step": step}}, "refcounts": {}, "version": "0.0.1"}))
    (out / "model.yaml").write_text(f"_target_: nemo.collections.llm.gpt.model.base.GPTModel\nstep: {step}\n")


def nemo_save_one(root: Path, step: int, last: bool) -> Path:
    """One ``ModelCheckpoint._save_checkpoint`` (NeMo, model_checkpoint.py @8cfedd7, sync save, no EMA):
    touch the ``-unfinished`` marker; ``trainer.save_checkpoint`` -> ``MegatronCheckpointIO.save_checkpoint``
    (pl.py: makedirs ``<ckpt>/weights``, megatron-core ``dist_checkpointing.save`` into it); ``io_dump`` of
    ``context/``; finalize: remove the marker."""
    ckpt = root / nemo_name(step, last)
    marker = nemo_marker(ckpt)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    weights = ckpt / "weights"
    os.makedirs(weights, exist_ok=True)
    mcore_replay(weights)
    _nemo_io_dump(ckpt, step)
    if marker.exists():
        marker.unlink()
    return ckpt


MCORE_TEMPLATE_ENV = "RLSUP_TEST_MCORE_TEMPLATE"  # a subprocess builder reuses the session's real MCore save
MCORE_ORDER = ("mkdir", "common.pt", "mkdir", "__0_0.distcp", "__0_1.distcp", ".metadata.tmp", "rename",
               "metadata.json")


def _write_copy(src: Path, dst: Path) -> None:
    with open(dst, "wb") as f:
        f.write(src.read_bytes())


def mcore_replay(weights: Path, template: Path | None = None) -> None:
    """megatron-core 0.16 ``dist_checkpointing.save`` (torch_dist, FileSystemWriterAsync, thread_count 2),
    replayed from one real save (:func:`layout_builders.mcore_dist_template`) in the order a recorded
    real save makes its file operations (:data:`MCORE_ORDER`; checked by the NeMo test): a real save
    spawns a multiprocessing manager and forks its shard writers (about 20 s here), too slow to repeat
    for every kill point."""
    env = os.environ.get(MCORE_TEMPLATE_ENV)
    src = template or (Path(env) if env else lb.mcore_dist_template())
    for op in MCORE_ORDER:
        if op == "mkdir":
            weights.mkdir(parents=True, exist_ok=True)
        elif op == "rename":
            os.rename(weights / ".metadata.tmp", weights / ".metadata")
        else:
            _write_copy(src / op.removesuffix(".tmp"), weights / op)


def nemo_remove(ckpt: Path) -> None:
    """``ModelCheckpoint._remove_checkpoint``: marker set, the checkpoint directory removed, marker removed."""
    marker = nemo_marker(ckpt)
    marker.touch()
    shutil.rmtree(ckpt)
    if marker.exists():
        marker.unlink()


def nemo_save(root: Path, step: int, previous_last: int | None = None) -> None:
    """What Lightning's ``on_train_batch_end`` does with NeMo's ModelCheckpoint (save_last=True):
    ``_save_topk_checkpoint`` (a full save named ``...step=N...``), then ``_save_last_checkpoint`` (a
    second full save named ``...-last``), then the previous ``-last`` is removed."""
    nemo_save_one(root, step, last=False)
    nemo_save_one(root, step, last=True)
    if previous_last is not None:
        nemo_remove(root / nemo_name(previous_last, last=True))


class NemoResumeError(Exception):
    """AutoResume refuses to resume (its ValueError/NotFoundError)."""


def nemo_autoresume_pick(checkpoint_dir: Path) -> Path | None:
    """``AutoResume._find_trainer_ckpt_path`` (resume.py @8cfedd7, resume_if_exists=True): directories
    matching ``*last`` without an ``-unfinished`` marker; several: the newest by mtime; if ``*last``
    directories exist but all are unfinished it raises."""
    dirs = [d for d in checkpoint_dir.glob("*") if d.is_dir()]
    last = [d for d in dirs if d.match("*last")]
    finished = [d for d in last if not nemo_marker(d).exists()]
    if last and not finished:
        raise NemoResumeError("Last checkpoint is unfinished and cannot be used to resume the training.")
    if not finished:
        return None
    if len(finished) > 1:
        return sorted(finished, key=lambda p: p.lstat().st_mtime, reverse=True)[0]
    return finished[0]


# ---------------------------------------------------------------- NeMo-RL


def _tiny_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A tiny model and an AdamW holding the state one step leaves (filled directly: a real first
    step imports torch._dynamo, seconds on this machine)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(float(seed)), "exp_avg": torch.randn_like(p),
                        "exp_avg_sq": torch.rand_like(p)}
    return model, opt


def nemo_rl_save(root: Path, step: int, keep_top_k: int | None = None) -> Path:
    """GRPO's save (NeMo-RL @01e9028: grpo.py then checkpoint.py, DTensor policy):
    ``CheckpointManager.init_tmp_checkpoint`` (rmtree a stale ``tmp_step_N``, mkdir, ``training_info.json``,
    ``config.yaml``); ``policy.save_checkpoint`` = native_checkpoint.save_checkpoint (real ``dcp.save`` of
    ``{"model": ...}`` to ``policy/weights``, of ``{"optim": ...}`` to ``policy/optimizer``, tokenizer
    ``save_pretrained`` files); ``torch.save`` of the dataloader state to ``train_dataloader.pt``;
    ``finalize_checkpoint``: ``_rename_checkpoint`` (tmp_step_N -> step_N, swapping an existing step_N
    through old_step_N) and ``remove_old_checkpoints`` (keep_top_k, no metric: most recent k)."""
    import torch.distributed.checkpoint as dcp
    import yaml

    save_dir = root / f"tmp_step_{step}"
    if save_dir.exists():
        shutil.rmtree(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    with open(save_dir / "training_info.json", "w") as f:
        json.dump({"step": step, "consumed_samples": 8 * step, "total_steps": step}, f)
    with open(save_dir / "config.yaml", "w") as f:
        yaml.safe_dump({"grpo": {"max_num_steps": 100}, "checkpointing": {"checkpoint_dir": str(root)}}, f)
    model, opt = _tiny_model(step)
    policy = save_dir / "policy"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(policy / "weights"))
    dcp.save({"optim": {"optim": opt.state_dict()}}, checkpoint_id=str(policy / "optimizer"))
    tok = policy / "tokenizer"
    tok.mkdir(parents=True, exist_ok=True)
    for name, data in (("tokenizer_config.json", {"model_max_length": 64}), ("special_tokens_map.json", {}),
                       ("tokenizer.json", {"version": "1.0", "model": {"type": "BPE"}})):
        with open(tok / name, "w") as f:
            json.dump(data, f)
    torch.save({"_sampler_iter_yielded": step, "_num_yielded": step}, save_dir / "train_dataloader.pt")
    _nemo_rl_rename(save_dir)
    if keep_top_k is not None:
        _nemo_rl_remove_old(root, keep_top_k)
    return root / f"step_{step}"


def _nemo_rl_rename(checkpoint_path: Path) -> None:
    step = checkpoint_path.name.split("_")[2]
    to_path = checkpoint_path.parent / f"step_{step}"
    if to_path.exists():
        old = checkpoint_path.parent / f"old_step_{step}"
        os.rename(to_path, old)
        os.rename(checkpoint_path, to_path)
        if old.exists():
            shutil.rmtree(old)
    else:
        os.rename(checkpoint_path, to_path)


def _nemo_rl_remove_old(root: Path, keep_top_k: int) -> None:
    history = sorted(((int(p.name.split("_")[1]), p) for p in root.glob("step_*")
                      if p.name[5:].isdigit() and (p / "training_info.json").exists()), reverse=True)
    protected = {s for s, _ in history[:keep_top_k]} | ({history[0][0]} if history else set())
    for s, p in history:
        if s not in protected:
            shutil.rmtree(p)


def nemo_rl_latest(checkpoint_dir: Path) -> Path | None:
    """``CheckpointManager.get_latest_checkpoint_path`` (@01e9028): the highest ``step_\\d+`` directory;
    nothing in it is looked at."""
    import re

    dirs = [p for p in checkpoint_dir.glob("step_*") if re.fullmatch(r"step_\d+", p.name)]
    return max(dirs, key=lambda p: int(p.name.split("_")[1])) if dirs else None


# ---------------------------------------------------------------- torchtitan


class _TrainState:
    """torchtitan's Trainer.state_dict shape: step and token counters as tensors."""

    def __init__(self, step: int) -> None:
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "ntokens_seen": torch.tensor(64 * self.step)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])


def torchtitan_states(step: int, model_only: bool = False) -> dict[str, Any]:
    """``CheckpointManager._flattened_model_states_sd``: model keys flattened at the top, then
    train_state, optimizer (flattened optimizer state dict), lr_scheduler and dataloader."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model, opt = _tiny_model(step)
    sd: dict[str, Any] = dict(model.state_dict())
    if model_only:
        return sd
    sd["train_state"] = _TrainState(step).state_dict()
    sd["optimizer"] = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    sd["lr_scheduler"] = {"lr_scheduler_0": {"last_epoch": step, "_step_count": step + 1}}
    sd["dataloader"] = {"dp_rank_0": torch.tensor([step], dtype=torch.int64), "world_size": 1}
    return sd


def torchtitan_save(root: Path, step: int, keep_latest_k: int = 0, last: str | None = None) -> Path:
    """``CheckpointManager._save`` (torchtitan @b5bcd76, components/checkpointer/dcp.py, sync mode):
    ``dcp_save`` of the flattened states to ``<folder>/step-N`` (real ``dcp.save``: shards, then
    ``.metadata`` through ``.metadata.tmp`` + rename), then ``_purge_stale_checkpoints`` (keep_latest_k:
    ``shutil.rmtree`` of all but the newest k ``step-N``; in torchtitan a purge thread does it).
    ``last="model_only"`` / ``"hf"``: ``_save_last_step`` with ``last_save_model_only`` (model keys only)
    or ``last_save_in_hf`` (``HuggingFaceStorageWriter``, consolidated into ``model-*.safetensors`` +
    ``model.safetensors.index.json``)."""
    import torch.distributed.checkpoint as dcp

    checkpoint_id = root / f"step-{step}"
    if last == "hf":
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        states = {f"model.{k}": v for k, v in torchtitan_states(step, model_only=True).items()}
        writer = HuggingFaceStorageWriter(path=str(checkpoint_id), save_distributed=True, enable_consolidation=True)
        dcp.save(states, storage_writer=writer, checkpoint_id=None)
        return checkpoint_id
    dcp.save(torchtitan_states(step, model_only=last == "model_only"), checkpoint_id=str(checkpoint_id))
    if keep_latest_k > 0 and last is None:
        found = sorted((int(p.name[5:]), p) for p in root.glob("step-*") if p.name[5:].isdigit())
        for _, path in found[: -keep_latest_k]:
            shutil.rmtree(path, ignore_errors=True)
    return checkpoint_id


def torchtitan_find_load_step(folder: Path) -> int:
    """``CheckpointManager._find_load_step`` (@b5bcd76): the highest ``step-(\\d+)`` (re.search) whose
    directory holds a ``.metadata`` file or a ``model.safetensors.index.json``; -1 when none."""
    import re

    if not folder.is_dir():
        return -1
    steps = []
    for name in os.listdir(folder):
        m = re.search(r"step-(\d+)", name)
        step_dir = folder / name
        if m and ((step_dir / ".metadata").is_file() or (step_dir / "model.safetensors.index.json").is_file()):
            steps.append(int(m.group(1)))
    return max(steps) if steps else -1


# ---------------------------------------------------------------- bench trees (lead: benchmarks/bench_selection.py)


def _bench(root: Path, steps: int, make: Callable[[Path, int], Path], name: Callable[[int], str],
           root_files: Callable[[Path, int], None] = lambda r, s: None) -> None:
    """One real save copied (hardlinked) ``steps - 1`` times; the newest made by a real save stopped
    before its last file operations (as a killed save leaves it)."""
    template_root = root / ".bench-template"
    src = make(template_root, 1)
    for s in range(1, steps):
        lb.copy_tree(src, root / name(s))
        root_files(root, s)
    newest = steps
    total = len(run_ops(root / ".probe", lambda: make(root / ".probe", newest)).events)
    shutil.rmtree(root / ".probe", ignore_errors=True)
    run_ops(root, lambda: make(root, newest), stop_at=max(1, total - 2))
    shutil.rmtree(template_root, ignore_errors=True)


def nemo_bench_tree(root: Path, steps: int) -> None:
    """``steps`` NeMo 2 ``-last`` steps; the newest one killed in its save (``-unfinished`` marker left)."""
    _bench(root, steps, lambda r, s: nemo_save_one(r, s, last=True), lambda s: nemo_name(s, last=True))


def nemo_rl_bench_tree(root: Path, steps: int) -> None:
    """``steps`` NeMo-RL ``step_N``; the newest one killed before its rename (``tmp_step_N`` left)."""
    _bench(root, steps, nemo_rl_save, lambda s: f"step_{s}")


def torchtitan_bench_tree(root: Path, steps: int) -> None:
    """``steps`` torchtitan ``step-N``; the newest one killed before its ``.metadata`` rename."""
    _bench(root, steps, torchtitan_save, lambda s: f"step-{s}")


BUILDERS: dict[str, Callable[[Path, int], Any]] = {
    "nemo": lambda root, step: nemo_save(root, step, previous_last=step - 1 if step > 1 else None),
    "nemo-rl": lambda root, step: nemo_rl_save(root, step),
    "torchtitan": lambda root, step: torchtitan_save(root, step),
}


def killed_job(layout: str, root: Path) -> int:
    """First attempt of an ``rlsup run`` job: save step 1, then die by SIGKILL inside step 2's save:
    NeMo-RL/torchtitan just before the commit rename, NeMo 2 inside the ``-last`` copy (its top-k copy
    of step 2 already finished)."""
    import signal

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        BUILDERS[layout](root, 1)
        probe = root.parent / (root.name + ".probe")
        lb.copy_tree(root, probe)
        events = rel_events(run_ops(probe, lambda: BUILDERS[layout](probe, 2)))
        shutil.rmtree(probe, ignore_errors=True)
        k = (index_of(events, "open", nemo_name(2, last=True) + "/weights/metadata.json") if layout == "nemo"
             else index_of(events, "os.rename", "2"))
        run_ops(root, lambda: BUILDERS[layout](root, 2), stop_at=k)
    os.kill(os.getpid(), signal.SIGKILL)
    return 1


JOB_SCRIPT = """import os, sys
if os.environ.get("RLSUP_RESUME_DIR"):
    print("RESUME", os.environ["RLSUP_RESUME_STEP"], os.path.basename(os.environ["RLSUP_RESUME_DIR"]), flush=True)
    sys.exit(0)
sys.path.insert(0, {tests!r})
import source_builders
source_builders.killed_job({layout!r}, source_builders.Path(os.environ["RLSUP_CHECKPOINT_DIR"]))
"""


def job_script(path: Path, layout: str) -> Path:
    """A job for ``rlsup run --checkpoint-dir``: attempt 0 runs :func:`killed_job`; a resumed attempt prints
    ``RESUME <RLSUP_RESUME_STEP> <basename of RLSUP_RESUME_DIR>`` (without importing torch) and exits 0."""
    path.write_text(JOB_SCRIPT.format(tests=str(Path(__file__).resolve().parent), layout=layout))
    return path


def main(argv: list[str]) -> int:
    """``source_builders.py LAYOUT ROOT STEP...``: run the builder for each step (for kill_matrix)."""
    layout, root, steps = argv[0], Path(argv[1]), [int(s) for s in argv[2:]]
    with warnings.catch_warnings():  # kill_matrix's hook announces torch.save itself
        warnings.simplefilter("ignore")
        for step in steps:
            BUILDERS[layout](root, step)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
