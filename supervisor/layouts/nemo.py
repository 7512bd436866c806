"""NeMo 2 checkpoints: ``<name>--...-step=N-consumed_samples=...[-last]/`` with ``weights/`` and ``context/``.

What one save does (NeMo ``nemo/lightning/pytorch/callbacks/model_checkpoint.py``, ``io/pl.py``,
``io/mixin.py`` at 8cfedd7, NeMo 2.5 era), per checkpoint directory:

1. ``ModelCheckpoint._save_checkpoint`` touches the sibling marker ``<ckpt>-unfinished``;
2. ``MegatronCheckpointIO.save_checkpoint`` writes ``<ckpt>/weights/`` with megatron-core
   ``dist_checkpointing.save`` (``common.pt``, shards, ``.metadata``, ``metadata.json`` last);
3. ``TrainerContext.io_dump`` writes ``<ckpt>/context/`` (``io.json``, artifacts, ``model.yaml``);
4. the finalize callback removes the marker (for async saves, when the async write is done).

Lightning saves each step twice with ``save_last=True`` (the top-k name, then ``...-last``) and then
removes the previous ``-last``; a removal also sets the marker first and clears it after. So a
directory whose marker exists is being written or deleted, or was when the job died: never valid, and
rlsup never deletes or touches it (NeMo's own ``ModelCheckpoint.setup`` deletes it on the next start).
The marker is the commit point; the file checks below catch trees copied without their markers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from supervisor.layouts import megatron
from supervisor.layouts.files import is_dir, read_json, step_dirs, tree_size
from supervisor.layouts.record import Check, CheckpointRecord

NAME = "nemo"
MARKER_SUFFIX = "-unfinished"
EMA_SUFFIX = "-EMA"
STEP_RE = re.compile(r"(?:^|-)step=(\d+)(?=-|$)")
WEIGHTS = "weights"
CONTEXT = "context"
IO_JSON = "io.json"
MODEL_YAML = "model.yaml"


@dataclass
class NemoContext:
    """Run-wide facts: whether this run writes ``context/`` (``enable_nemo_ckpt_io``, on by default)."""

    expects_context: bool
    expects_model_yaml: bool = False


def step_of(path: Path) -> int | None:
    """The N of ``step=N`` in a NeMo checkpoint directory name (None for markers and other names)."""
    if path.name.endswith(MARKER_SUFFIX):
        return None
    m = STEP_RE.search(path.name)
    return int(m.group(1)) if m else None


def marker_of(path: Path) -> Path:
    """``format_checkpoint_unfinished_marker_path``: the path minus ``.ckpt`` and ``-EMA``, plus ``-unfinished``."""
    return Path(str(path).removesuffix(".ckpt").removesuffix(EMA_SUFFIX) + MARKER_SUFFIX)


def owns(path: Path) -> bool:
    """A directory named ``...step=N...`` holding ``weights/`` or ``context/``, or with its marker beside it."""
    if step_of(path) is None or not is_dir(path):
        return False
    return is_dir(path / WEIGHTS) or is_dir(path / CONTEXT) or marker_of(path).exists()


def list_steps(root: Path) -> list[tuple[int, Path]]:
    """Every ``step=N`` directory (top-k and ``-last`` both); ``-last`` sorts after its twin, so it is tried first."""
    return step_dirs(root, step_of)


def looks_like(root: Path) -> bool:
    return any(owns(p) for _, p in list_steps(root)[-4:])


def make_context(root: Path) -> NemoContext:
    """A run writes ``context/`` when any finished step of it has one."""
    for _, path in reversed(list_steps(root)):
        if not marker_of(path).exists() and is_dir(path / CONTEXT):
            return NemoContext(expects_context=True, expects_model_yaml=(path / CONTEXT / MODEL_YAML).exists())
    return NemoContext(expects_context=False)


def check_context(directory: Path, expects_model_yaml: bool = False) -> Check:
    """``context/io.json`` parses (opened first, written after the artifacts are copied, in ``io_dump``);
    every JSON artifact (tokenizer files) parses; ``model.yaml`` (written last) is there when the run
    writes it, and no yaml file is empty."""
    if not is_dir(directory):
        return Check.bad(f"{CONTEXT}/ missing (io_dump writes it after weights/)")
    data, err = read_json(directory / IO_JSON)
    if err:
        return Check.bad(f"{CONTEXT}/{err}")
    if not isinstance(data, dict):
        return Check.bad(f"{CONTEXT}/{IO_JSON} is not an object")
    for artifact in sorted(directory.rglob("*.json")):
        _, err = read_json(artifact)
        if err:
            return Check.bad(f"{CONTEXT}/{artifact.relative_to(directory).parent}/{err}".replace("/./", "/"))
    if expects_model_yaml and not (directory / MODEL_YAML).exists():
        return Check.bad(f"{CONTEXT}/{MODEL_YAML} missing (io_dump writes it last)")
    for y in directory.glob("*.yaml"):
        try:
            if y.stat().st_size == 0:
                return Check.bad(f"{CONTEXT}/{y.name} is empty (torn write)")
        except OSError as exc:
            return Check.bad(f"{CONTEXT}/{y.name} unreadable: {exc}")
    return Check.good()


def check_step(path: Path, ctx: NemoContext) -> Check:
    marker = marker_of(path)
    if marker.exists():
        return Check.bad(f"{marker.name} present: NeMo was saving or deleting this checkpoint (killed mid-way, "
                         "or still running); left alone, NeMo removes it on its next start")
    if path.name.endswith(EMA_SUFFIX):
        return Check.bad("EMA copy (the EMA callback's weights swapped in): not a training state to resume; "
                         "NeMo resumes from the copy without -EMA")
    if not is_dir(path / WEIGHTS):
        return Check.bad(f"{WEIGHTS}/ missing (killed before MegatronCheckpointIO wrote it)")
    weights = megatron.check_mcore_dist(path / WEIGHTS)
    if not weights.ok:
        return weights
    notes = list(weights.notes)
    if ctx.expects_context or is_dir(path / CONTEXT):
        context = check_context(path / CONTEXT, ctx.expects_model_yaml)
        if not context.ok:
            return Check.bad(context.reason, notes)
    else:
        notes.append("no context/ in this run (enable_nemo_ckpt_io off?): weights only")
    return Check.good(notes)


def verify_step(path: Path, step: int | None = None, ctx: NemoContext | None = None) -> CheckpointRecord:
    """A step is valid when it has no ``-unfinished`` marker, ``weights/`` passes the MCore dist checks
    and ``context/`` (when the run writes one) has a parsing ``io.json``."""
    check = check_step(path, ctx or make_context(path.parent))
    s = step if step is not None else step_of(path)
    return CheckpointRecord.of_check(check, step=s, layout=NAME, path=path, size_bytes=tree_size(path),
                                     role="last" if path.name.endswith("-last") else None)
