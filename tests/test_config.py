"""Config: precedence flag > env > file > default; bad keys and types exit 2 naming key, file and line."""

from __future__ import annotations

from pathlib import Path

from conftest import ROOT, run_rlsup

from supervisor.config import reference_markdown


def test_precedence_flag_env_file_default(workdir: Path) -> None:
    cfg = workdir / "rlsup.yaml"
    cfg.write_text("max_restarts: 7\nkill_grace: 4\nbackoff_max: 9\nheartbeat_timeout: auto\n")
    r = run_rlsup(["config", "show", "--config", str(cfg), "--kill-grace", "1.5"], workdir,
                  RLSUP_BACKOFF_MAX="11", RLSUP_STARTUP_TIMEOUT="99")
    assert r.returncode == 0, r.stderr
    lines = {line.split(":")[0]: line for line in r.stdout.splitlines()}
    assert lines["max_restarts"].startswith("max_restarts: 7  # ") and f"{cfg}:1" in lines["max_restarts"]
    assert "kill_grace: 1.5  # flag --kill-grace" in lines["kill_grace"]
    assert "backoff_max: 11.0  # env RLSUP_BACKOFF_MAX" in lines["backoff_max"]
    assert "startup_timeout: 99.0  # env RLSUP_STARTUP_TIMEOUT" in lines["startup_timeout"]
    assert "heartbeat_timeout: auto" in lines["heartbeat_timeout"]
    assert "stop_grace: 60.0  # default" in lines["stop_grace"]


def test_unknown_key_names_key_file_and_line(workdir: Path) -> None:
    cfg = workdir / "bad.yaml"
    cfg.write_text("max_restarts: 2\n\nmax_restart: 3\n")
    r = run_rlsup(["run", "--config", str(cfg), "--", "true"], workdir)
    assert r.returncode == 2
    assert f"{cfg}:3: unknown key 'max_restart' (did you mean 'max_restarts'?)" in r.stderr


def test_wrong_type_in_file(workdir: Path) -> None:
    cfg = workdir / "bad.yaml"
    cfg.write_text("kill_grace: 1\nmax_restarts: lots\n")
    r = run_rlsup(["run", "--config", str(cfg), "--", "true"], workdir)
    assert r.returncode == 2
    assert f"{cfg}:2: key 'max_restarts': expected an integer, got 'lots'" in r.stderr
    assert not (workdir / ".rlsup").exists()  # nothing started


def test_wrong_type_in_flag_and_env(workdir: Path) -> None:
    r = run_rlsup(["run", "--heartbeat-timeout", "soon", "--", "true"], workdir)
    assert r.returncode == 2 and "flag --heartbeat-timeout: key 'heartbeat_timeout'" in r.stderr
    r = run_rlsup(["run", "--", "true"], workdir, RLSUP_FATAL_EXIT_CODES="1,x")
    assert r.returncode == 2 and "environment RLSUP_FATAL_EXIT_CODES: key 'fatal_exit_codes'" in r.stderr


def test_unreadable_and_malformed_file(workdir: Path) -> None:
    r = run_rlsup(["run", "--config", str(workdir / "missing.yaml"), "--", "true"], workdir)
    assert r.returncode == 2 and "missing.yaml: cannot read config file" in r.stderr
    cfg = workdir / "broken.yaml"
    cfg.write_text("max_restarts: 1\nkill_grace: [1,\n")
    r = run_rlsup(["run", "--config", str(cfg), "--", "true"], workdir)
    assert r.returncode == 2 and f"{cfg}:" in r.stderr and "malformed YAML" in r.stderr


def test_invalid_value(workdir: Path) -> None:
    cfg = workdir / "bad.yaml"
    cfg.write_text("preempt_signal: SIGNOPE\n")
    r = run_rlsup(["run", "--config", str(cfg), "--", "true"], workdir)
    assert r.returncode == 2 and f"{cfg}:1: key 'preempt_signal': unknown signal" in r.stderr


def test_reference_doc_is_generated_from_code() -> None:
    assert (ROOT / "docs" / "config.md").read_text() == reference_markdown(), \
        "docs/config.md is stale: run `rlsup config reference > docs/config.md`"


def test_replication_settings_errors_exit_2(workdir: Path) -> None:
    peers = ["--peers", "127.0.0.1:1,127.0.0.1:2", "--node-rank", "0"]
    r = run_rlsup(["daemon", *peers], workdir)
    assert r.returncode == 2 and "key 'token_file'" in r.stderr, r.stderr
    short = workdir / "token"
    short.write_text("short\n")
    short.chmod(0o600)
    r = run_rlsup(["daemon", *peers, "--token-file", str(short)], workdir)
    assert r.returncode == 2 and str(short) in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run_rlsup(["run", "--peers", "127.0.0.1:1", "--node-rank", "0", "--", "true"], workdir)
    assert r.returncode == 2 and "single node" in r.stderr
    r = run_rlsup(["run", *peers, "--replication-factor", "2", "--", "true"], workdir)
    assert r.returncode == 2 and "replication_factor 2 needs more than 2 nodes" in r.stderr


def test_a_boolean_flag_alone_means_true(workdir: Path) -> None:
    """`--repair-tracker` as the recipes type it (no value), and `--repair-tracker false`."""
    r = run_rlsup(["config", "show", "--repair-tracker", "--resume", "false"], workdir)
    assert r.returncode == 0, r.stderr
    lines = {line.split(":")[0]: line for line in r.stdout.splitlines()}
    assert "repair_tracker: true  # flag --repair-tracker" in lines["repair_tracker"]
    assert "resume: false  # flag --resume" in lines["resume"]


def test_checkpoint_layout_accepts_every_layout_the_catalogue_dispatches_on_and_the_readme_names() -> None:
    """The choices come from the layout catalogue itself (a hand-written list once refused `hf`)."""
    import re

    import pytest

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
