"""Config: precedence flag > env > file > default; bad keys and types exit 2 naming key, file and line.

``load_config`` is a pure function, so the CLI is called in this process (``supervisor.cli.main.main``: the same
parsing, the same exit codes, rlsup's lines on the captured stderr); one test starts ``rlsup`` as a process, for
what only a process shows (the exit status and stderr of a real ``rlsup daemon``, no traceback).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Iterator

import pytest
from support.env import ROOT

from supervisor import log as rlsup_log
from supervisor.cli.main import main
from supervisor.config import reference_markdown

Rlsup = Callable[..., "tuple[int, str, str]"]


@pytest.fixture
def rlsup(workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Iterator[Rlsup]:
    """``rlsup ARGS`` in this process, in ``workdir``, with the environment a test run gives it (no RLSUP_*
    but the ones passed, metrics off): (exit code, stdout, stderr). The logging setup main() changes is put back."""
    monkeypatch.chdir(workdir)
    for var in [v for v in os.environ if v.startswith("RLSUP_")]:
        monkeypatch.delenv(var)
    loggers = [logging.getLogger(name) for name in rlsup_log.ROOTS]
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in loggers]

    def call(*args: str, **env: str) -> tuple[int, str, str]:
        with monkeypatch.context() as m:
            for var, value in {"RLSUP_METRICS_PORT": "0", **env}.items():
                m.setenv(var, value)
            code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    yield call
    for lg, handlers, level, propagate in saved:
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate
    rlsup_log.set_context(node=None, attempt=None)


def test_precedence_flag_env_file_default(workdir: Path, rlsup: Rlsup) -> None:
    cfg = workdir / "rlsup.yaml"
    cfg.write_text("max_restarts: 7\nkill_grace: 4\nbackoff_max: 9\nheartbeat_timeout: auto\n")
    code, out, err = rlsup("config", "show", "--config", str(cfg), "--kill-grace", "1.5",
                           RLSUP_BACKOFF_MAX="11", RLSUP_STARTUP_TIMEOUT="99")
    assert code == 0, err
    lines = {line.split(":")[0]: line for line in out.splitlines()}
    assert lines["max_restarts"].startswith("max_restarts: 7  # ") and f"{cfg}:1" in lines["max_restarts"]
    assert "kill_grace: 1.5  # flag --kill-grace" in lines["kill_grace"]
    assert "backoff_max: 11.0  # env RLSUP_BACKOFF_MAX" in lines["backoff_max"]
    assert "startup_timeout: 99.0  # env RLSUP_STARTUP_TIMEOUT" in lines["startup_timeout"]
    assert "heartbeat_timeout: auto" in lines["heartbeat_timeout"]
    assert "stop_grace: 60.0  # default" in lines["stop_grace"]


def test_unknown_key_names_key_file_and_line(workdir: Path, rlsup: Rlsup) -> None:
    cfg = workdir / "bad.yaml"
    cfg.write_text("max_restarts: 2\n\nmax_restart: 3\n")
    code, _, err = rlsup("run", "--config", str(cfg), "--", "true")
    assert code == 2
    assert f"{cfg}:3: unknown key 'max_restart' (did you mean 'max_restarts'?)" in err


def test_wrong_type_in_file(workdir: Path, rlsup: Rlsup) -> None:
    cfg = workdir / "bad.yaml"
    cfg.write_text("kill_grace: 1\nmax_restarts: lots\n")
    code, _, err = rlsup("run", "--config", str(cfg), "--", "true")
    assert code == 2
    assert f"{cfg}:2: key 'max_restarts': expected an integer, got 'lots'" in err
    assert not (workdir / ".rlsup").exists()  # nothing started


def test_wrong_type_in_flag_and_env(rlsup: Rlsup) -> None:
    code, _, err = rlsup("run", "--heartbeat-timeout", "soon", "--", "true")
    assert code == 2 and "flag --heartbeat-timeout: key 'heartbeat_timeout'" in err
    code, _, err = rlsup("run", "--", "true", RLSUP_FATAL_EXIT_CODES="1,x")
    assert code == 2 and "environment RLSUP_FATAL_EXIT_CODES: key 'fatal_exit_codes'" in err


def test_unreadable_and_malformed_file(workdir: Path, rlsup: Rlsup) -> None:
    code, _, err = rlsup("run", "--config", str(workdir / "missing.yaml"), "--", "true")
    assert code == 2 and "missing.yaml: cannot read config file" in err
    cfg = workdir / "broken.yaml"
    cfg.write_text("max_restarts: 1\nkill_grace: [1,\n")
    code, _, err = rlsup("run", "--config", str(cfg), "--", "true")
    assert code == 2 and f"{cfg}:" in err and "malformed YAML" in err


def test_invalid_value(workdir: Path, rlsup: Rlsup) -> None:
    cfg = workdir / "bad.yaml"
    cfg.write_text("preempt_signal: SIGNOPE\n")
    code, _, err = rlsup("run", "--config", str(cfg), "--", "true")
    assert code == 2 and f"{cfg}:1: key 'preempt_signal': unknown signal" in err


def test_reference_doc_is_generated_from_code() -> None:
    assert (ROOT / "docs" / "config.md").read_text() == reference_markdown(), \
        "docs/config.md is stale: run `rlsup config reference > docs/config.md`"


PEERS = ("--peers", "127.0.0.1:1,127.0.0.1:2", "--node-rank", "0")


def test_node_membership_errors_exit_2(rlsup: Rlsup) -> None:
    """The keys that depend on the node's place among the job's nodes, refused before anything starts."""
    code, _, err = rlsup("run", "--peers", "127.0.0.1:1", "--node-rank", "0", "--", "true")
    assert code == 2 and "flag --peers: key 'peers'" in err and "single node" in err
    code, _, err = rlsup("run", *PEERS, "--replication-factor", "2", "--", "true")
    assert code == 2 and "replication_factor 2 needs more than 2 nodes" in err
    code, _, err = rlsup("run", "--peers", "127.0.0.1:1,127.0.0.1:2", "--node-rank", "5", "--", "true")
    assert code == 2 and "key 'peers'/'node_rank'" in err
    code, _, err = rlsup("daemon")
    assert code == 2 and "rlsup daemon needs peers" in err
    code, _, err = rlsup("run", "--memory-dir", "shm", "--disk-every-seconds", "5", *PEERS, "--", "true")
    assert code == 2 and "flag --disk-every-seconds: key 'disk_every_seconds'" in err and "use disk_every" in err


def test_node_membership_from_slurm() -> None:
    """Without peers, SLURM's allocation names the nodes; one node of it, or none, is a single-node run."""
    from supervisor.config import load_config, node_membership

    eff = load_config(environ={})
    slurm = {"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1"}
    membership = node_membership(eff, slurm)
    assert membership is not None and membership.node_rank == 1 and membership.peers == ("gpu07:9779", "gpu08:9779")
    assert node_membership(eff, {**slurm, "SLURM_JOB_NUM_NODES": "1"}) is None
    assert node_membership(eff, {}) is None


def test_a_boolean_flag_alone_means_true(rlsup: Rlsup) -> None:
    """`--repair-tracker` as the recipes type it (no value), and `--repair-tracker false`."""
    code, out, err = rlsup("config", "show", "--repair-tracker", "--resume", "false")
    assert code == 0, err
    lines = {line.split(":")[0]: line for line in out.splitlines()}
    assert "repair_tracker: true  # flag --repair-tracker" in lines["repair_tracker"]
    assert "resume: false  # flag --resume" in lines["resume"]


def test_checkpoint_layout_accepts_every_layout_the_catalogue_dispatches_on_and_the_readme_names() -> None:
    """The choices come from the layout catalogue itself (a hand-written list once refused `hf`)."""
    import re

    from supervisor import layouts
    from supervisor.config import ConfigError, load_config
    from supervisor.layouts import single_file

    dispatched = set(layouts.LAYOUTS)
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Trainer layouts rlsup understands"):text.index("### Checkpoints rlsup cannot read")]
    readme = {name for row in re.findall(r"^\|([^|]+)\|", table, re.M) for name in re.findall(r"`([a-z-]+)`", row)}
    assert {"hf", "deepspeed", "lightning", "nemo", "nemo-rl", "torchtitan", "rlsup", "dcp"} <= readme
    for name in dispatched | readme | {"auto", single_file.NAME}:
        assert load_config(environ={}, overrides={"checkpoint_layout": name}).config.checkpoint_layout == name
    with pytest.raises(ConfigError, match=r"unknown layout 'hugginface' \(one of auto, rlsup"):
        load_config(environ={}, overrides={"checkpoint_layout": "hugginface"})
    with pytest.raises(ConfigError, match="checkpoint_file"):
        load_config(environ={}, overrides={"checkpoint_layout": "hf", "checkpoint_file": "ckpt.pt"})
    with pytest.raises(ConfigError, match="relative to checkpoint_dir"):
        load_config(environ={}, overrides={"checkpoint_file": "../elsewhere/ckpt.pt"})


def test_min_nodes_is_set_by_file_env_and_flag(workdir: Path, rlsup: Rlsup) -> None:
    """Issue 43's floor of a shrunk job, settable as every key is (flag > env > file > default)."""
    cfg = workdir / "rlsup.yaml"
    cfg.write_text("min_nodes: 2\n")
    code, out, err = rlsup("config", "show", "--config", str(cfg))
    assert code == 0 and f"min_nodes: 2  # {cfg}:1" in out, out + err
    code, out, err = rlsup("config", "show", "--config", str(cfg), RLSUP_MIN_NODES="3")
    assert code == 0 and "min_nodes: 3  # env RLSUP_MIN_NODES" in out, out + err
    code, out, err = rlsup("config", "show", "--config", str(cfg), "--min-nodes", "1", RLSUP_MIN_NODES="3")
    assert code == 0 and "min_nodes: 1  # flag --min-nodes" in out, out + err
    code, out, err = rlsup("config", "show")
    assert code == 0 and "min_nodes: 0  # default" in out, out + err


def test_min_nodes_refusals_name_the_key_and_the_numbers(rlsup: Rlsup) -> None:
    """Below 0, above the job's node count (peers less spares: both numbers named), or on a single node: exit 2
    before anything starts."""
    code, _, err = rlsup("run", "--min-nodes", "-1", *PEERS, "--", "true")
    assert code == 2 and "flag --min-nodes: key 'min_nodes': must be >= 0" in err, err
    code, _, err = rlsup("run", "--min-nodes", "3", *PEERS, "--", "true")
    assert code == 2 and "flag --min-nodes: key 'min_nodes': 3 is more than the job's 2 node(s)" in err, err
    four = ("--peers", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3,127.0.0.1:4", "--node-rank", "0")
    code, _, err = rlsup("run", *four, "--spares", "1", "--", "true", RLSUP_MIN_NODES="4")
    assert code == 2 and "env RLSUP_MIN_NODES: key 'min_nodes': 4 is more than the job's 3 node(s)" in err, err
    assert "(4 peers less 1 spare(s))" in err, err
    code, _, err = rlsup("run", "--min-nodes", "1", "--", "true")
    assert code == 2 and "flag --min-nodes: key 'min_nodes': min_nodes needs peers" in err, err


def test_min_nodes_within_the_job_is_accepted_and_0_means_every_node() -> None:
    from supervisor.cluster.round_lead import ShrinkSettings
    from supervisor.config import load_config, node_membership

    four = {"peers": ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4"), "node_rank": 0, "spares": 1}
    for floor in (0, 1, 3):
        membership = node_membership(load_config(environ={}, overrides={**four, "min_nodes": floor}), {})
        assert membership is not None and membership.size == 4
    assert node_membership(load_config(environ={}, overrides={"min_nodes": 0}), {}) is None  # single node: default
    assert ShrinkSettings(0).floor(3) is None  # the default: never shrink (every node, always)
    assert ShrinkSettings(2).floor(3) == 2 and ShrinkSettings(3).floor(3) is None  # the job's own size: never fewer
