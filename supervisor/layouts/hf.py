"""Hugging Face Transformers Trainer and TRL trainers (SFT, DPO, GRPO...): ``<output_dir>/checkpoint-N/``.

Write order (transformers 5.23, ``transformers/trainer.py``, ``Trainer._save_checkpoint``): ``save_model``
(``config.json``, ``generation_config.json``, ``model*.safetensors`` + ``model.safetensors.index.json`` when
sharded, or ``adapter_model.safetensors`` for PEFT, tokenizer files, ``training_args.bin``), then
``_save_optimizer_and_scheduler`` (``optimizer.pt``; FSDP: accelerate's ``pytorch_model_fsdp_0/`` and
``optimizer_0/`` DCP directories; DeepSpeed: ``global_stepN/`` + ``latest``), ``scheduler.pt``, ``scaler.pt``,
``rng_state.pth`` (``rng_state_R.pth`` per rank when distributed), and last, on rank 0 only,
``trainer_state.json``; then ``rotate_checkpoints`` may delete older steps (``save_total_limit``). Nothing is
atomic (plain ``open("w")`` / ``torch.save``) and there is no barrier between rank 0's ``trainer_state.json``
and the other ranks' ``rng_state_R.pth`` (nor, in DeepSpeed 0.19.8, between rank 0's ``latest`` and the other
ranks' ZeRO files: the barrier comes after it).

So a step is usable when ``trainer_state.json`` parses and says ``global_step == N`` (rank 0's commit
point), the weights are intact, every torch.save file is an intact zip, and the files this run's other
steps have (optimizer, scheduler, scaler, as many ``rng_state_R.pth`` as the previous committed step) are
here: Trainer's own resume silently skips a missing optimizer, scheduler or RNG file.
``transformers.trainer_utils.get_last_checkpoint`` just takes the highest N.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.layouts import dcp
from supervisor.layouts.files import check_safetensors, check_zip, read_json, step_dirs, tree_size
from supervisor.layouts.record import Check, CheckpointRecord

NAME = "hf"
STEP_RE = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.json"
RNG_RE = re.compile(r"^rng_state(?:_(\d+))?\.pth$")
# torch.save files Trainer/accelerate write next to the weights; required when the run's other steps have them.
STATE_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "training_args.bin", "optimizer.bin",
               "pytorch_model_fsdp.bin")
SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
FSDP_DIR_RE = re.compile(r"^(pytorch_model_fsdp|optimizer)_(\d+)$")
DS_LATEST = "latest"
DS_MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
DS_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


@dataclass
class HFContext:
    """The run's steps, and (lazily, cached) which are committed and what files they hold. Lazy because
    trainer_state.json carries the whole log_history: parsing every step's on each selection would cost
    O(steps x history) where one neighbour's parse answers the question."""

    steps: list[tuple[int, Path]] = field(default_factory=list)
    _committed: dict[int, set[str] | None] = field(default_factory=dict)  # step -> names, None: not committed

    def names_if_committed(self, step: int, path: Path) -> set[str] | None:
        if step not in self._committed:
            state, err = read_json(path / TRAINER_STATE)
            ok = err is None and isinstance(state, dict) and state.get("global_step") == step
            names = _names(path)
            counts = _ds_counts(path) if ok and DS_LATEST in names else None
            # a pseudo-entry: how many DeepSpeed model/optimizer rank files a complete step of this run has
            self._committed[step] = (names | ({f"ds:{counts[0]}:{counts[1]}"} if counts else set())) if ok else None
        return self._committed[step]


def step_of(path: Path) -> int | None:
    m = STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def list_steps(root: Path) -> list[tuple[int, Path]]:
    return step_dirs(root, step_of)


def looks_like(root: Path) -> bool:
    return bool(list_steps(root))


def owns(path: Path) -> bool:
    """A ``checkpoint-N`` directory (Trainer's and every TRL trainer's step directory)."""
    return path.is_dir() and step_of(path) is not None


def _names(path: Path) -> set[str]:
    try:
        return {p.name for p in path.iterdir()}
    except OSError:
        return set()


def _rng_count(names: set[str]) -> int:
    return sum(1 for n in names if RNG_RE.match(n))


def make_context(root: Path) -> HFContext:
    return HFContext(steps=list_steps(root))


def reference_names(ctx: HFContext, step: int) -> set[str] | None:
    """Files of the nearest older committed step (else the nearest newer one): what a complete step of this
    run holds. Usually one trainer_state.json parse."""
    older = [(s, p) for s, p in ctx.steps if s < step]
    newer = [(s, p) for s, p in ctx.steps if s > step]
    for s, p in [*reversed(older), *newer]:
        names = ctx.names_if_committed(s, p)
        if names is not None:
            return names
    return None


def check_trainer_state(path: Path, step: int | None) -> Check:
    state, err = read_json(path / TRAINER_STATE)
    if err:
        if "missing" in err:
            err += " (rank 0 writes it last: save killed before it finished)"
        return Check.bad(err)
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        return Check.bad(f"{TRAINER_STATE} has no integer global_step")
    if step is not None and state["global_step"] != step:
        return Check.bad(f"{TRAINER_STATE} says global_step {state['global_step']} but the directory is "
                         f"checkpoint-{step} (stale or copied)")
    return Check.good()


def _check_index(path: Path, index_name: str) -> Check:
    data, err = read_json(path / index_name)
    if err:
        return Check.bad(err)
    shards = sorted(set((data or {}).get("weight_map", {}).values())) if isinstance(data, dict) else []
    if not shards:
        return Check.bad(f"{index_name} has an empty weight_map")
    for name in shards:
        c = check_safetensors(path / name) if name.endswith(".safetensors") else check_zip(path / name)
        if not c.ok:
            return Check.bad(f"shard of {index_name}: {c.reason}")
    return Check.good([f"{len(shards)} weight shards"])


def _one_file(path: Path) -> Check:
    return check_safetensors(path) if path.suffix == ".safetensors" else check_zip(path)


def check_weights(path: Path, names: set[str]) -> Check:
    """Full weights (single file or index + shards), PEFT adapters, or FSDP's own model state."""
    checks: list[Check] = []
    for index in (SAFE_INDEX, BIN_INDEX):
        if index in names:
            checks.append(_check_index(path, index))
    if not checks:
        for single in ("model.safetensors", "pytorch_model.bin"):
            if single in names:
                checks.append(_one_file(path / single))
    for adapter in ("adapter_model.safetensors", "adapter_model.bin"):
        if adapter in names:
            checks.append(_one_file(path / adapter))
    for sub in sorted(n for n in names if (path / n).is_dir()):
        for adapter in ("adapter_model.safetensors", "adapter_model.bin"):
            if (path / sub / adapter).exists():
                c = _one_file(path / sub / adapter)
                checks.append(Check.bad(f"{sub}/{c.reason}") if not c.ok else c)
    for sub in sorted(n for n in names if FSDP_DIR_RE.match(n) and n.startswith("pytorch_model_fsdp")):
        checks.append(_check_dcp_dir(path / sub))
    if "pytorch_model_fsdp.bin" in names:
        checks.append(check_zip(path / "pytorch_model_fsdp.bin"))
    if not checks:
        if DS_LATEST in names:
            return Check.good(["no consolidated weights (DeepSpeed ZeRO-3 without gather): weights in the "
                               "DeepSpeed tag directory"])
        return Check.bad("no model weights (model.safetensors, an index, adapter_model.*, or FSDP state)")
    bad = [c for c in checks if not c.ok]
    return bad[0] if bad else Check.good([n for c in checks for n in c.notes])


def _check_dcp_dir(sub: Path) -> Check:
    c = dcp.check_dcp(sub)
    return c if c.ok else Check.bad(f"{sub.name}/: {c.reason}", c.notes)


def _ds_counts(path: Path) -> tuple[int, int] | None:
    try:
        tag = (path / DS_LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    files = _names(path / tag) if tag and "/" not in tag else set()
    return sum(1 for f in files if DS_MODEL_RE.match(f)), sum(1 for f in files if DS_OPTIM_RE.match(f))


def _ds_want(expect: set[str] | None) -> tuple[int, int] | None:
    for n in expect or ():
        if n.startswith("ds:"):
            _, m, o = n.split(":")
            return int(m), int(o)
    return None


def check_deepspeed(path: Path, names: set[str], want: tuple[int, int] | None = None) -> Check:
    """``latest`` names a tag directory holding intact model-state and ZeRO optimizer files, ranks 0..n-1."""
    try:
        tag = (path / DS_LATEST).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return Check.bad(f"DeepSpeed {DS_LATEST} missing (rank 0 writes it at the end of save_checkpoint)")
    except (OSError, UnicodeDecodeError) as exc:
        return Check.bad(f"DeepSpeed {DS_LATEST} unreadable: {exc}")
    if not tag or "/" in tag or tag not in names or not (path / tag).is_dir():
        return Check.bad(f"DeepSpeed {DS_LATEST} names tag {tag!r}, which is not a directory here")
    files = _names(path / tag)
    model = [m for m in map(DS_MODEL_RE.match, files) if m]
    optim = [m for m in map(DS_OPTIM_RE.match, files) if m]
    if not model:
        return Check.bad(f"{tag}/ has no *_model_states.pt (killed before DeepSpeed saved the model)")
    for kind, found, need in (("model_states", model, want[0] if want else 0),
                              ("optim_states", optim, want[1] if want else 0)):
        ranks = sorted({int(m.group(1) or 0) for m in found})
        if ranks and ranks != list(range(ranks[-1] + 1)):
            missing = sorted(set(range(ranks[-1] + 1)) - set(ranks))
            return Check.bad(f"{tag}/: {kind} files missing for ranks {missing[:8]}")
        if len(found) < need:
            return Check.bad(f"{tag}/: {len(found)} {kind} file(s), the run's previous step has {need} (a rank was "
                             "killed before DeepSpeed saved its part; rank 0 writes latest without waiting)")
        for m in found:
            c = check_zip(path / tag / m.group(0))
            if not c.ok:
                return Check.bad(f"{tag}/{c.reason}")
    notes = [] if tag == f"global_step{step_of(path)}" else [f"DeepSpeed tag {tag} differs from the step"]
    return Check.good([f"DeepSpeed tag {tag}: {len(model)} model, {len(optim)} optimizer files", *notes])


def check_rng(path: Path, names: set[str], want: int | None) -> Check:
    indices = sorted(int(m.group(1) or 0) for m in map(RNG_RE.match, names) if m)
    if indices and indices != list(range(len(indices))) and "rng_state.pth" not in names:
        missing = sorted(set(range(indices[-1] + 1)) - set(indices))
        return Check.bad(f"rng_state files missing for ranks {missing[:8]}")
    if want is not None and len(indices) < want:
        first = "rng_state.pth" if want == 1 else f"rng_state_{len(indices)}.pth"
        return Check.bad(f"{first} missing: {len(indices)} rng_state file(s), the run's previous step has {want} "
                         "(a rank was killed before saving its RNG state)")
    for n in sorted(n for n in names if RNG_RE.match(n)):
        c = check_zip(path / n)
        if not c.ok:
            return c
    return Check.good()


def check_files(path: Path, names: set[str], expect: set[str] | None) -> Check:
    """torch.save files intact; JSON files parse; files the run's previous complete step had are here."""
    for n in sorted(names):
        if n in STATE_FILES:
            c = check_zip(path / n)
            if not c.ok:
                return c
        elif n.endswith(".json") and n != TRAINER_STATE:
            _, err = read_json(path / n)
            if err:
                return Check.bad(err)
    if expect is not None:
        for n in STATE_FILES + ("config.json", DS_LATEST):
            if n in expect and n not in names:
                return Check.bad(f"{n} missing while the run's previous step has it (killed before it was saved)")
        for n in sorted(x for x in expect if FSDP_DIR_RE.match(x)):
            if n not in names:
                return Check.bad(f"{n}/ missing while the run's previous step has it (killed before it was saved)")
    for n in sorted(x for x in names if FSDP_DIR_RE.match(x) and x.startswith("optimizer")):
        c = _check_dcp_dir(path / n)
        if not c.ok:
            return c
    return Check.good()


# Files only rank 0's _save_checkpoint writes, all before trainer_state.json (other ranks' rng files may come later).
REWRITTEN = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "training_args.bin",
             "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth", "rng_state_0.pth")
MTIME_SLACK_S = 1.0


def rewrite_notes(path: Path, names: set[str]) -> list[str]:
    """A resumed run that reaches N again saves into the existing checkpoint-N (``os.makedirs(exist_ok=True)``);
    killed before its new trainer_state.json, the old one still parses over a mix of two saves' files. Only a
    note: a copy that did not keep mtimes (``cp -r``) looks the same, and rejecting every copied step would
    restart the run from scratch."""
    try:
        committed = (path / TRAINER_STATE).stat().st_mtime
    except OSError:
        return []
    for n in sorted(x for x in names if x in REWRITTEN or x.startswith("model-0")):
        try:
            if (path / n).stat().st_mtime > committed + MTIME_SLACK_S:
                return [f"{n} is newer than {TRAINER_STATE}: a later save rewrote this directory and may not have "
                        "finished, or the step was copied without its mtimes"]
        except OSError:
            continue
    return []


def verify_step(path: Path, step: int | None = None, ctx: HFContext | None = None) -> CheckpointRecord:
    step = step if step is not None else step_of(path)
    ctx = ctx if ctx is not None else make_context(path.parent)
    names = _names(path)
    expect = reference_names(ctx, step) if step is not None else None
    want_rng = _rng_count(expect) if expect is not None else None
    checks = [("", lambda: check_trainer_state(path, step)), ("weights: ", lambda: check_weights(path, names)),
              ("", lambda: check_files(path, names, expect)), ("", lambda: check_rng(path, names, want_rng))]
    if DS_LATEST in names or any(n.startswith("global_step") for n in names):
        checks.append(("", lambda: check_deepspeed(path, names, _ds_want(expect))))
    notes: list[str] = rewrite_notes(path, names)
    valid, reason = True, "complete"
    for prefix, run in checks:
        c = run()
        notes.extend(c.notes)
        if not c.ok:
            valid, reason = False, prefix + c.reason
            break
    if valid and not any(n in names for n in ("optimizer.pt", "optimizer.bin", DS_LATEST)) and \
            not any(FSDP_DIR_RE.match(n) and n.startswith("optimizer") for n in names):
        notes.append("no optimizer state (save_only_model?): a resume restarts the optimizer")
    return CheckpointRecord(step=-1 if step is None else step, layout=NAME, path=path, valid=valid, reason=reason,
                            size_bytes=tree_size(path), notes=notes)
