"""Supervisor configuration: one dataclass, four sources, errors that name the key, file and line.

Precedence is flag > environment (``RLSUP_<KEY>``) > YAML file > default. The reference in
``docs/config.md`` is generated from :class:`SupervisorConfig` (``rlsup config reference``), so the
documented defaults cannot drift from the code.

A key whose value is one of a fixed set is typed ``Literal[...]`` with the names the code dispatches on,
from :mod:`supervisor.settings_vocabulary` (the layouts, the progress presets, the straggler actions, the
coordination backends) and :mod:`supervisor.log` (the log formats), never from a component: this module
imports none (components import the config, never the reverse). The check, the flag's metavar, the help
and the reference all read :func:`choices`, so no list is written twice. Every check of a value lives here
(:func:`_validate`, and :func:`node_membership` for the keys that depend on the node's place among the
job's nodes).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from supervisor.log import LogFormat
from supervisor.membership import Membership, MembershipError, from_config, replica_targets
from supervisor.settings_vocabulary import (CATALOGUE_LAYOUTS, PROGRESS_PRESETS, REFUSED_FOR_S, SINGLE_FILE_LAYOUT,
                                            CoordinatorBackend, StragglerAction, step_pattern)

ENV_PREFIX = "RLSUP_"
DEFAULT_CHECKPOINT_DIR = "checkpoints"
#: checkpoint_layout's choices: auto, the layout catalogue's names, single-file (one list, never written twice).
LAYOUT_CHOICES = ("auto", *CATALOGUE_LAYOUTS, SINGLE_FILE_LAYOUT)
LayoutChoice = Literal[LAYOUT_CHOICES]  # type: ignore[valid-type]  # built from the vocabulary at import
#: progress's choices: off (empty) or a preset's name (supervisor.diagnosis.step_reports.PRESETS).
PROGRESS_CHOICES = ("", *PROGRESS_PRESETS)
ProgressChoice = Literal[PROGRESS_CHOICES]  # type: ignore[valid-type]


class ConfigError(Exception):
    """A bad configuration value; the message names the key and where it came from."""


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class SupervisorConfig:
    """Everything ``rlsup run`` and ``rlsup daemon`` can be told. Defaults are the embedded default.

    Frozen: nothing changes a loaded config (a change would bypass validation and provenance);
    build another with :func:`dataclasses.replace`, or give values as a source of
    :func:`load_config` (``overrides``, as ``rlsup demo`` does). List-valued keys hold tuples. Each component takes its own small
    settings object built from it (``RestartSettings.from_config``, ``HangSettings.from_config``,
    ``MetricsSettings.from_config``), not the whole config."""

    checkpoint_dir: str = _opt(DEFAULT_CHECKPOINT_DIR, "Where the job's checkpoints live (passed as RLSUP_CHECKPOINT_DIR).")
    state_dir: str = _opt(".rlsup", "rlsup's own state: incidents.jsonl, state.json, attempt logs, heartbeat files.")
    max_restarts: int = _opt(3, "Restarts allowed within restart_window before rlsup gives up.")
    restart_window: float = _opt(3600.0, "Seconds after which an old failure stops counting against max_restarts (0: never).")
    backoff_initial: float = _opt(1.0, "Delay before the second restart in a row without a newer valid checkpoint, seconds; doubles per further such failure. The first failure after a healthy run restarts at once.")
    backoff_max: float = _opt(60.0, "Upper bound of the restart delay, seconds.")
    backoff_jitter: float = _opt(0.2, "Random +/- fraction applied to each delay so nodes do not restart in lockstep.")
    fatal_exit_codes: tuple[int, ...] = _opt((), "Exit codes that are never retried; rlsup exits with that code, except one of rlsup's own (2, 75, 76, 77) or above 125, which exits 1 (README: Exit codes).")
    kill_grace: float = _opt(10.0, "Seconds between SIGTERM and SIGKILL when what is left of a succeeded, stopped or preempted attempt is cleaned up; a failed attempt is killed with SIGKILL at once. A process still alive kill_grace seconds after SIGKILL is examined: one in state D (a hung NFS/Lustre/FUSE mount) ends the run 'unkillable' with exit 77, the node in unhealthy_nodes, never a next attempt beside it.")
    stop_grace: float = _opt(60.0, "Seconds the job gets to save and exit after rlsup is asked to stop or is preempted; also the most the final copy to the persistent tier may take when the run ends.")
    heartbeat_timeout: float | None = _opt(None, "Seconds a rank that has heartbeated may stay silent; 'auto' (null) learns it from step intervals.")
    heartbeat_timeout_initial: float = _opt(600.0, "Timeout used by 'auto' until enough step intervals were seen (counted across attempts, and across rlsup runs of the same command: heartbeat_timeout.json in state_dir).")
    auto_timeout_factor: float = _opt(5.0, "'auto': timeout = factor x the longest ordinary step interval observed (a stall the job survived, over 2x the ordinary step, is not learned; the first step after a launch or restore neither: docs/hangs.md).")
    auto_timeout_floor: float = _opt(30.0, "'auto': the learned timeout is never below this many seconds.")
    auto_timeout_min_intervals: int = _opt(5, "'auto': step intervals to observe before the learned timeout replaces the initial one.")
    startup_timeout: float = _opt(600.0, "Seconds from launch within which some rank must heartbeat, else the attempt counts as hung; also the limit of each rank's first step after a launch or restore (communicator set-up, compilation, first batch), which never teaches the learned timeout.")
    save_timeout: float = _opt(1800.0, "Seconds a rank may spend in a save or load section before it counts as hung.")
    max_no_progress_attempts: int = _opt(5, "Stop restarting after this many failed attempts in a row without progress: no "
                                         "newer valid checkpoint, nor a step past the highest an earlier attempt reached "
                                         "(0: off).")
    preempt_signal: str = _opt("SIGUSR1", "Signal that means 'preemption coming': relayed so the trainer saves (should_stop()), then rlsup exits for requeue.")
    poll_interval: float = _opt(0.1, "Seconds between checks of the job's processes and heartbeats.")
    output_tail_lines: int = _opt(40, "Lines of the job's output kept in each incident record.")
    log_format: LogFormat = _opt("text", "Shape of rlsup's own lines on stderr: text (time, node, attempt, then [rlsup] and the message) or json (one object per line, for log shippers). The job's output is never reformatted.", noun="format")
    warm_launcher: bool = _opt(True, "For `torchrun ...` and `python -m torch.distributed.run ...` jobs: while an attempt runs, pre-spawn the next attempt's launcher (the job's interpreter with torchrun already imported), so a restart skips interpreter start and import.")
    warm_imports: tuple[str, ...] = _opt((), "With warm_launcher: modules each warm rank imports (after torch) before it becomes a worker, e.g. your model library. They are imported under the attempt's environment before the rank's RANK, LOCAL_RANK and the next attempt's RLSUP_* variables are set: list only modules whose import does not read those.")
    warm_cuda: bool = _opt(False, "With warm_launcher, on a node with NVIDIA GPUs: each warm rank also starts CUDA (its context on the device of its local rank) while it waits, so a restarted rank skips CUDA start-up; skipped for GPUs not in the default compute mode. Off by default: the warm ranks wait while the attempt runs, so each GPU holds one more CUDA context (about 0.5 GB on an H200) beside a job that may need all its memory, for about 0.1 s saved per restarted rank (measured on an H200). Leave it off for a trainer that sets CUDA_VISIBLE_DEVICES itself or uses CUDA in processes it forks.")
    warm_first_attempt: bool = _opt(True, "With warm_launcher: the first attempt (and any other no launcher was armed for) starts from one spawned for it, as later attempts start from theirs: with warm_fork its ranks share one torch import (a cold torchrun's ranks import it each), so the first attempt starts sooner and a node's ranks load torch's files once. false: such an attempt is torchrun's cold start.")
    warm_fork: bool = _opt(True, "With warm_launcher: the warm ranks are forked from the launcher, which imports torch once for them (a spawned warm rank imports it itself: about 2 s of CPU and 0.3 GB of its own per rank), wherever a fork is what a fresh interpreter would be (torch imported under the workers' start-up environment, no module beside the script shadowing one the launcher imported, a launcher of one thread); else, and false, each is spawned. Forked ranks share one Python str hash seed (cold ranks draw one each unless PYTHONHASHSEED is set).")
    resume: bool = _opt(True, "Pick the newest valid checkpoint before each attempt and pass it as RLSUP_RESUME_DIR (empty: start fresh), which every rank must load; false: the trainer chooses.")
    checkpoint_layout: LayoutChoice = _opt("auto", f"Checkpoint layout to read: auto, or one of {', '.join(LAYOUT_CHOICES[1:])} (docs/layouts.md). auto takes single-file only when no other layout recognises checkpoint_dir.", noun="layout")
    checkpoint_file: str = _opt("", "single-file checkpoints: the file (or glob) the trainer saves whole, relative to checkpoint_dir, e.g. ckpt.pt, *.ckpt, model.safetensors; empty: every top-level .pt/.pth/.ckpt/.safetensors file.")
    file_versions_keep: int = _opt(2, "single-file checkpoints: complete versions kept aside in <checkpoint_dir>/.rlsup-versions/ (a hard link when the trainer writes a new file per save, else a copy: up to this many times the file's size on disk); before a restart the newest is put back where the file is torn or missing. 0: off.")
    file_versions_max_bytes: int = _opt(0, "single-file checkpoints: most bytes the kept versions may take together (0: no cap beyond file_versions_keep); each file's newest kept version always stays.")
    quarantine_invalid: bool = _opt(False, "Before each attempt, rename a torn checkpoint newer than the newest valid one to <name>.rlsup-invalid-<unix time> (never deleted; `rlsup checkpoints list` shows it; only you put it back, with mv), so a trainer that picks 'latest' itself skips it.")
    progress: ProgressChoice = _opt("", f"Read progress from the job's output in a trainer's own format: {', '.join(PROGRESS_CHOICES[1:])} (docs/progress.md); for trainers that do not call trainer_hooks. Only a training step that moves is a heartbeat: redraws, lower steps and other bars (evaluation, saving, data) are not.", noun="preset")
    progress_regex: str = _opt("", "A regular expression; an output line it matches is a heartbeat of the whole job when its step (the first group, or the group named step) passes the highest step seen in the attempt (a redraw of the same step is not; bars that are not a training loop's never are: docs/progress.md). Overrides progress. Rank heartbeats from trainer_hooks take precedence.")
    straggler_factor: float = _opt(1.5, "A rank whose own work per step stays this many times its peers' median (heartbeat arrivals before the step's collective, or trainer_hooks.section('work')) over straggler_window steps is reported as a straggler; 0: off.")
    straggler_window: int = _opt(10, "Consecutive steps a rank must be that slow to be reported (and fast again to be cleared).")
    straggler_action: StragglerAction = _opt("report", "report: log, stragglers.jsonl, rlsup_stragglers metric, no restart; restart: a straggler also ends the attempt, like a hang.", noun="action")
    pre_launch_check: str = _opt("", "Shell command run on this node before every attempt (e.g. 'nvidia-smi', 'dcgmi diag -r 1', a filesystem probe), or 'builtin': rlsup's own NVML check (needs nvidia-ml-py on GPU nodes; fails with fewer GPUs than --nproc-per-node or CUDA_VISIBLE_DEVICES ask, a lost GPU, a pending page retirement or row remap, failed row remapping, or uncorrected ECC errors; a node without GPUs passes with 'no GPUs: skipped'). A non-zero exit, a failure or a timeout marks the node unhealthy: rlsup stops with exit 77 and appends the node's name to <state_dir>/unhealthy_nodes. Empty: no check.")
    pre_launch_timeout: float = _opt(300.0, "Seconds pre_launch_check may take before it counts as failed.")
    repair_tracker: bool = _opt(False, "Rewrite a trainer's tracker (verl/Megatron latest_checkpointed_iteration.txt, DeepSpeed latest) to the chosen step before a restart, so its own resume loads that step.")
    metrics_port: int = _opt(9778, "Port of the Prometheus /metrics endpoint (0: off). 9778 avoids node_exporter, DCGM and Prometheus' own ports.")
    metrics_addr: str = _opt("0.0.0.0", "Address the /metrics endpoint binds to.")
    job_name: str = _opt("", "The job's identity: every checkpoint part, replica, coordination key and persistent copy carries it, and no job is offered another's (empty: SLURM_JOB_ID, else the checkpoint_dir). Also shown in the rlsup_info metric.")
    peers: tuple[str, ...] = _opt((), "Replication endpoints host:port of every node, in node-rank order (empty: from SLURM, else single node).")
    node_rank: int | None = _opt(None, "This node's index in peers (default: SLURM_NODEID).")
    spares: int = _opt(0, "How many of the last peers are spare nodes: they run rlsup and hold no ranks until a node of the job is lost; then one takes the lost node's rank, fetches its parts from their holders, and every node resumes from the same step. The job runs on len(peers) - spares nodes. With warm_launcher, a waiting spare holds its first attempt's warm launcher and nproc_per_node idle warm ranks (torch imported; with warm_cuda a CUDA context each), so a takeover starts warm.")
    spare_takeover_s: float = _opt(3.0, "Seconds a node may be missing from a round (its inventory absent while the others' are there) before a spare takes its node rank; "
                                   f"sooner when the node's host refuses connects to its endpoint for {REFUSED_FOR_S:g} s (its rlsup is gone: nothing listens there). "
                                   "A node that arrives later is refused (exit 77) and may rejoin as a spare.")
    min_nodes: int = _opt(0, "Fewest nodes the job may run on: when a node is lost and no spare takes its rank within "
                          "spare_takeover_s (sooner once its endpoint refuses connects, as for a spare), the job "
                          "goes on with the nodes left if at least min_nodes remain and the trainer's checkpoints can "
                          "be restored into another world size (trainer_hooks saves marked resizable); otherwise it "
                          "waits and requeues (exit 75) as before. Once the lost node (or a replacement) is back, the "
                          "job grows back to the full node count at its next save (not counted against max_restarts). "
                          "Node 0 lost: only with coordinator_backend etcd (the embedded store goes with node 0); "
                          "another node then leads the rounds until node 0 is back. 0: the job's node count (len(peers) - spares): never shrink. Needs peers; at most the job's "
                          "node count.")
    replication_port: int = _opt(9779, "Port of the replication endpoint when peers come from SLURM or omit a port.")
    coordinator_port: int = _opt(9780, "Port of the coordination store (rlsup's own, authenticated with token_file) hosted by node 0's supervisor (coordinator_backend embedded).")
    coordinator_backend: CoordinatorBackend = _opt("embedded", "Where the nodes agree before each attempt: embedded (a store hosted by node 0's supervisor; a replacement node 0 hosts it again) or etcd (an etcd v3 cluster, coordinator_endpoints; no node's loss stalls the others).", noun="backend")
    coordinator_endpoints: tuple[str, ...] = _opt((), "coordinator_backend etcd: client URLs host:port of the etcd members (the gRPC gateway, etcd's default client port).")
    token_file: str = _opt("", "File holding the shared secret that authenticates every replication request (mode 600).")
    replica_dir: str = _opt("replicas", "Where this node stores the replicas it holds for other nodes.")
    replication_factor: int = _opt(1, "Copies of each node's checkpoint parts kept on other nodes.")
    replication_jump: int = _opt(1, "Ring step between a node and its replica holders (e.g. nodes per rack).")
    replication_bandwidth: float = _opt(0.0, "Cap on replication traffic in bytes/s (0: unlimited).")
    replication_concurrency: int = _opt(4, "Transfers in flight at once.")
    replication_scan_interval: float = _opt(5.0, "Seconds between full rescans of the checkpoint directory (events trigger passes sooner).")
    rendezvous_timeout: float = _opt(600.0, "Seconds to wait for every node before an attempt starts.")
    tls_cert: str = _opt("", "PEM certificate for the replication endpoint (empty: plain HTTP with HMAC auth).")
    tls_key: str = _opt("", "PEM private key for tls_cert.")
    tls_ca: str = _opt("", "CA bundle that peers' certificates must chain to.")
    persistent_dir: str = _opt("", "Persistent checkpoint tier: a shared-filesystem directory or fsspec URL (s3://...) that valid rlsup-layout steps are copied to and restored from (empty: off).")
    persistent_every: int = _opt(0, "Copy to the persistent tier once this many steps passed since the last copy (0: every new valid step).")
    persistent_every_seconds: float = _opt(0.0, "Copy to the persistent tier once this many seconds passed since the last copy (0: off); with persistent_every, either one triggers.")
    persistent_keep_last: int = _opt(0, "Valid copies kept in the persistent tier (0: all); the newest valid copy is never deleted.")
    persistent_bandwidth: float = _opt(0.0, "Cap on persistent-tier traffic in bytes/s, reads and writes together (0: unlimited).")
    memory_dir: str = _opt("", "Memory checkpoint tier: a tmpfs directory (e.g. /dev/shm) the ranks save into, owned by rlsup (each job in its own subdirectory), drained to checkpoint_dir in the background; empty: off. Takes about (memory_keep_last + 1) x the node's checkpoint size in RAM.")
    memory_keep_last: int = _opt(2, "Valid steps kept in the memory tier; the newest valid step and the step being resumed from are never deleted.")
    memory_limit_bytes: int = _opt(0, "Most bytes the memory tier may use on memory_dir; a save that would go over goes to checkpoint_dir instead, with a warning (0: the free space of memory_dir decides).")
    disk_every: int = _opt(0, "Drain a memory-tier step to checkpoint_dir once this many steps passed since the last drained one (0 with disk_every_seconds 0: every new valid step). On several nodes: the first step at or past each multiple, the same step on every node.")
    disk_every_seconds: float = _opt(0.0, "Drain a memory-tier step to checkpoint_dir once this many seconds passed since the last drain (0: off); with disk_every, either one triggers. Single node only (nodes would drain different steps): refused with peers.")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # a list given in code becomes a tuple: no change after load
            if isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))

    def resolved(self, base: Path | None = None) -> "SupervisorConfig":
        """Paths made absolute, so attempts launched in other directories agree."""
        base = base or Path.cwd()
        return dataclasses.replace(
            self,
            checkpoint_dir=str((base / self.checkpoint_dir).resolve()),
            state_dir=str((base / self.state_dir).resolve()),
            replica_dir=str((base / self.replica_dir).resolve()),
            memory_dir=str((base / self.memory_dir).resolve()) if self.memory_dir else "",
            persistent_dir=self.persistent_dir if not self.persistent_dir or "://" in self.persistent_dir
            else str((base / self.persistent_dir).resolve()),
        )


# ---------------------------------------------------------------- type coercion

@functools.lru_cache(maxsize=1)
def _field_types() -> dict[str, Any]:
    hints = typing.get_type_hints(SupervisorConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(SupervisorConfig)}


def choices(key: str) -> tuple[str, ...]:
    """The values a choice-valued key accepts, as the code it configures dispatches on (empty: not a choice)."""
    tp = _field_types()[key]
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()


def choice_keys() -> tuple[str, ...]:
    """Every key whose value is one of a fixed set."""
    return tuple(name for name in _field_types() if choices(name))


def _listed(key: str) -> str:
    """A key's choices as a sentence lists them (the empty choice, 'off', is said by the help)."""
    return ", ".join(c for c in choices(key) if c)


def _coerce(name: str, tp: Any, value: Any, *, from_text: bool) -> Any:
    """Check (file values) or parse (flags, environment) one value; raise ValueError naming the type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in ("auto", "null", "none", "")):
            return None
        return _coerce(name, args[0], value, from_text=from_text)
    if origin is tuple:  # list-valued keys: tuple[X, ...]
        inner = typing.get_args(tp)[0]
        if from_text and isinstance(value, str):
            value = [v for v in value.replace(",", " ").split() if v]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"expected a list, got {type(value).__name__} {value!r}")
        return tuple(_coerce(name, inner, v, from_text=from_text) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_text and isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ValueError(f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if from_text and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ValueError(f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        number = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif from_text and isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and math.isfinite(number):
            return number
        raise ValueError(f"expected a finite number of seconds, got {value!r}")
    if tp is str or origin is Literal:  # a choice is a name: _validate checks it against the choices
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"expected a string, got {value!r}")
    raise ValueError(f"unsupported type {tp}")


def _unknown(key: str, names: list[str]) -> str:
    close = difflib.get_close_matches(key, names, n=1)
    return f"unknown key '{key}'" + (f" (did you mean '{close[0]}'?)" if close else "")


# ---------------------------------------------------------------- sources

def load_file(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Values and their 'file:line' origins from a YAML mapping; raise ConfigError on any problem."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror or e}") from e
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: malformed YAML: {getattr(e, 'problem', e)}") from e
    if root is None:
        return {}, {}
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{path}:{root.start_mark.line + 1}: the config must be a mapping of key: value")
    types_ = _field_types()
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for key_node, value_node in root.value:
        key = key_node.value
        where = f"{path}:{key_node.start_mark.line + 1}"
        if key not in types_:
            raise ConfigError(f"{where}: {_unknown(str(key), list(types_))}")
        try:
            raw = yaml.safe_load(yaml.serialize(value_node))
            values[key] = _coerce(key, types_[key], raw, from_text=False)
        except (ValueError, OverflowError, yaml.YAMLError) as e:  # unsafe tags, 5000-digit ints
            raise ConfigError(f"{where}: key '{key}': {e}") from e
        origins[key] = where
    return values, origins


def load_env(environ: typing.Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    types_ = _field_types()
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for name, tp in types_.items():
        var = ENV_PREFIX + name.upper()
        if var in environ:
            try:
                values[name] = _coerce(name, tp, environ[var], from_text=True)
            except ValueError as e:
                raise ConfigError(f"environment {var}: key '{name}': {e}") from e
            origins[name] = f"env {var}"
    return values, origins


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--kebab-case`` flag per config key; unset flags stay absent so lower sources show through."""
    parser.add_argument("--config", "-c", type=Path, default=argparse.SUPPRESS, help="YAML config file.")
    types_ = _field_types()
    for f in dataclasses.fields(SupervisorConfig):
        switch = {"nargs": "?", "const": "true"} if types_[f.name] is bool else {}  # --repair-tracker alone: true
        # A choice's metavar lists its choices; the check itself is _validate's, so a bad value is refused with
        # the same message from a flag, the environment or a file (argparse's choices= would be a second check).
        metavar = "{" + _listed(f.name).replace(" ", "") + "}" if choices(f.name) else f.name.upper()
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f"cfg_{f.name}", default=argparse.SUPPRESS,
                            metavar=metavar, help=f.metadata["help"], **switch)


def load_flags(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    types_ = _field_types()
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for name, tp in types_.items():
        if hasattr(args, f"cfg_{name}"):
            flag = "--" + name.replace("_", "-")
            try:
                values[name] = _coerce(name, tp, getattr(args, f"cfg_{name}"), from_text=True)
            except ValueError as e:
                raise ConfigError(f"flag {flag}: key '{name}': {e}") from e
            origins[name] = f"flag {flag}"
    return values, origins


def _load_overrides(values: typing.Mapping[str, Any], origin: str) -> tuple[dict[str, Any], dict[str, str]]:
    types_ = _field_types()
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in types_:
            raise ConfigError(f"{origin}: {_unknown(key, list(types_))}")
        try:
            out[key] = _coerce(key, types_[key], value, from_text=False)
        except ValueError as e:
            raise ConfigError(f"{origin}: key '{key}': {e}") from e
    return out, {key: origin for key in out}


@dataclass(frozen=True)
class EffectiveConfig:
    """The merged config plus where each value came from (for ``rlsup config show``)."""

    config: SupervisorConfig
    origins: dict[str, str]


def load_config(args: argparse.Namespace | None = None, environ: typing.Mapping[str, str] | None = None,
                overrides: typing.Mapping[str, Any] | None = None, overrides_origin: str = "code") -> EffectiveConfig:
    """Merge the sources, then validate; ``overrides`` (values a command sets itself, e.g. ``rlsup
    demo``'s directories) sit above every other source and are validated with them."""
    environ = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    origins = {f.name: "default" for f in dataclasses.fields(SupervisorConfig)}
    config_path = getattr(args, "config", None) if args is not None else None
    if config_path is None and environ.get(ENV_PREFIX + "CONFIG"):
        config_path = Path(environ[ENV_PREFIX + "CONFIG"])
    layers = []
    if config_path is not None:
        layers.append(load_file(Path(config_path)))
    layers.append(load_env(environ))
    if args is not None:
        layers.append(load_flags(args))
    if overrides:
        layers.append(_load_overrides(overrides, overrides_origin))
    for values, where in layers:
        merged.update(values)
        origins.update(where)
    cfg = SupervisorConfig(**merged)
    _validate(cfg, origins)
    return EffectiveConfig(cfg, origins)


def _validate(cfg: SupervisorConfig, origins: dict[str, str]) -> None:
    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"{origins[key]}: key '{key}': {why}")

    fields = {f.name: f for f in dataclasses.fields(SupervisorConfig)}
    for key in choice_keys():
        if getattr(cfg, key) not in choices(key):
            off = " or empty (off)" if "" in choices(key) else ""
            noun = fields[key].metadata.get("noun", "value")  # what the choices are: layout, preset, ...
            raise bad(key, f"unknown {noun} {getattr(cfg, key)!r} (one of {_listed(key)}{off})")

    if not 0 <= cfg.metrics_port <= 65535:
        raise bad("metrics_port", "must be a port number 0..65535")
    for key in ("max_restarts", "max_no_progress_attempts", "output_tail_lines", "replication_factor", "min_nodes",
                "replication_bandwidth", "persistent_every", "persistent_every_seconds", "persistent_keep_last",
                "persistent_bandwidth", "memory_limit_bytes", "disk_every", "disk_every_seconds"):
        if getattr(cfg, key) < 0:
            raise bad(key, "must be >= 0")
    for key in ("backoff_initial", "backoff_max", "kill_grace", "stop_grace", "pre_launch_timeout", "startup_timeout", "save_timeout",
                "restart_window", "auto_timeout_floor", "heartbeat_timeout_initial"):
        if getattr(cfg, key) < 0:
            raise bad(key, "must be >= 0 seconds")
    for key in ("replication_port", "coordinator_port"):
        if not 0 < getattr(cfg, key) <= 65535:
            raise bad(key, "must be a port number 1..65535")
    if cfg.replication_jump < 1 or cfg.replication_concurrency < 1:
        raise bad("replication_jump" if cfg.replication_jump < 1 else "replication_concurrency", "must be >= 1")
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise bad("tls_key" if cfg.tls_cert else "tls_cert", "tls_cert and tls_key go together")
    if cfg.memory_keep_last < 1:
        raise bad("memory_keep_last", "must be >= 1 (the newest valid step always stays)")
    if cfg.memory_dir and "://" in cfg.memory_dir:
        raise bad("memory_dir", f"must be a local directory (a tmpfs such as /dev/shm), not a URL: {cfg.memory_dir!r}")
    if cfg.poll_interval <= 0:
        raise bad("poll_interval", "must be > 0")
    if cfg.spare_takeover_s <= 0:
        raise bad("spare_takeover_s", "must be > 0 seconds (a node that misses a round by a moment is not lost)")
    if cfg.heartbeat_timeout is not None and cfg.heartbeat_timeout <= 0:
        raise bad("heartbeat_timeout", "must be > 0 seconds or 'auto'")
    if not 0 <= cfg.backoff_jitter < 1:
        raise bad("backoff_jitter", "must be in [0, 1)")
    import signal as _signal

    name = cfg.preempt_signal if cfg.preempt_signal.startswith("SIG") else "SIG" + cfg.preempt_signal
    if not isinstance(getattr(_signal, name, None), _signal.Signals):
        raise bad("preempt_signal", f"unknown signal {cfg.preempt_signal!r}")
    if cfg.checkpoint_file and cfg.checkpoint_layout not in ("auto", SINGLE_FILE_LAYOUT):
        raise bad("checkpoint_file", f"names a single-file checkpoint, but checkpoint_layout is {cfg.checkpoint_layout!r}")
    if cfg.checkpoint_file and (Path(cfg.checkpoint_file).is_absolute() or ".." in Path(cfg.checkpoint_file).parts):
        raise bad("checkpoint_file", f"must be relative to checkpoint_dir, without '..': {cfg.checkpoint_file!r}")
    if cfg.file_versions_keep < 0 or cfg.file_versions_max_bytes < 0:
        raise bad("file_versions_keep" if cfg.file_versions_keep < 0 else "file_versions_max_bytes", "must be >= 0")
    if cfg.progress_regex:  # a preset's name is checked above (its regex is the code's: tests/diagnosis/test_progress.py)
        try:
            step_pattern(cfg.progress_regex)
        except ValueError as e:
            raise bad("progress_regex", str(e)) from None
    if cfg.straggler_factor < 0 or cfg.straggler_window < 1:
        raise bad("straggler_factor" if cfg.straggler_factor < 0 else "straggler_window",
                  "must be >= 0 (factor) and >= 1 (window)")
    if cfg.coordinator_backend == "etcd" and not cfg.coordinator_endpoints:
        raise bad("coordinator_endpoints", "coordinator_backend etcd needs the etcd members' host:port")


def node_membership(eff: EffectiveConfig, environ: typing.Mapping[str, str] | None = None, *,
                    command: Literal["run", "daemon"] = "run") -> Membership | None:
    """This node's place among the job's nodes (``peers`` and ``node_rank``, else SLURM's environment; None:
    a single node), checked with the keys that depend on it. Here, not in :func:`_validate`, because the
    answer depends on the environment a command runs in; ``rlsup daemon`` needs several nodes."""
    cfg, origins = eff.config, eff.origins

    def where(*keys: str) -> str:  # the origin of the first key that was set, as every error starts
        return next((f"{origins[k]}: " for k in keys if origins.get(k, "default") != "default"), "")

    environ = os.environ if environ is None else environ
    try:
        membership = from_config(cfg.peers, cfg.node_rank, cfg.replication_port, environ)
    except MembershipError as e:
        raise ConfigError(f"{where('peers', 'node_rank')}key 'peers'/'node_rank': {e}") from e
    if membership is None:
        if command == "daemon":
            raise ConfigError("rlsup daemon needs peers (key 'peers' and 'node_rank', or a SLURM allocation)")
        if cfg.min_nodes:
            raise ConfigError(f"{where('min_nodes')}key 'min_nodes': min_nodes needs peers (a single-node run "
                              "cannot shrink); leave it 0")
        return None
    if cfg.spares and not 0 <= cfg.spares <= membership.size - 2:  # (one peer: the membership's own error)
        raise ConfigError(f"{where('spares')}key 'spares': {cfg.spares} of {membership.size} peers leaves fewer than "
                          "2 nodes for the job")
    if membership.size < 2:
        raise ConfigError(f"{where('peers')}key 'peers': lists a single node; leave peers empty for a single-node run")
    job_size = membership.size - cfg.spares  # a spare replicates as the node whose rank it takes
    if cfg.min_nodes > job_size:
        raise ConfigError(f"{where('min_nodes')}key 'min_nodes': {cfg.min_nodes} is more than the job's {job_size} "
                          f"node(s) ({membership.size} peers less {cfg.spares} spare(s))")
    try:
        replica_targets(min(membership.node_rank, job_size - 1), job_size, cfg.replication_factor,
                        cfg.replication_jump)
    except MembershipError as e:
        raise ConfigError(f"{where('replication_factor', 'replication_jump')}key 'replication_factor'/"
                          f"'replication_jump': {e}") from e
    if command == "run" and cfg.memory_dir and cfg.disk_every_seconds:
        raise ConfigError(f"{origins['disk_every_seconds']}: key 'disk_every_seconds': on several nodes the memory "
                          "tier drains the same steps on every node, which a time cadence cannot promise (clocks and "
                          "speeds differ); use disk_every (steps) instead")
    return membership


# ---------------------------------------------------------------- rendering

def to_yaml(eff: EffectiveConfig) -> str:
    lines = []
    for f in dataclasses.fields(SupervisorConfig):
        value = getattr(eff.config, f.name)
        shown = "auto" if value is None else list(value) if isinstance(value, tuple) else value
        dumped = yaml.safe_dump({f.name: shown}, default_flow_style=True, width=10_000).strip()[1:-1]
        lines.append(f"{dumped}  # {eff.origins.get(f.name, 'default')}")
    return "\n".join(lines) + "\n"


def reference_markdown() -> str:
    """The config reference, generated from the dataclass (docs/config.md is this text)."""
    hints = _field_types()
    out = [
        "# Configuration reference",
        "",
        "Generated by `rlsup config reference` from `supervisor/config.py`; do not edit by hand.",
        "Precedence: flag > environment `RLSUP_<KEY>` > YAML file (`--config`) > default.",
        "",
        "| key | flag | type | default | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    defaults = SupervisorConfig()
    for f in dataclasses.fields(SupervisorConfig):
        tp = hints[f.name]
        tname = getattr(tp, "__name__", str(tp))
        if f.name == "heartbeat_timeout":
            tname = "seconds or auto"
        elif choices(f.name):
            tname = "one of " + ", ".join(f"`{c}`" for c in choices(f.name) if c) + (
                " or empty" if "" in choices(f.name) else "")
        elif typing.get_origin(tp) is tuple:
            tname = f"list of {typing.get_args(tp)[0].__name__}"
        elif typing.get_origin(tp) in (typing.Union, types.UnionType):
            tname = f"{typing.get_args(tp)[0].__name__} or null"
        default = getattr(defaults, f.name)
        shown = "auto" if default is None else list(default) if isinstance(default, tuple) else default
        out.append(f"| `{f.name}` | `--{f.name.replace('_', '-')}` | {tname} | `{shown}` | {f.metadata['help']} |")
    return "\n".join(out) + "\n"
