"""The end-to-end half of test_config.py (real processes, or waits on real time): config: precedence flag > env >
file > default; bad keys and types exit 2 naming key, file and line."""

from __future__ import annotations

from pathlib import Path

from support.procs import run_rlsup

from test_config import PEERS


def test_replication_settings_errors_exit_2(workdir: Path) -> None:
    """A real ``rlsup daemon`` (it installs signal handlers, so not in this process): a missing or short
    token file is a config error, exit 2, naming the key or the file, no traceback."""
    r = run_rlsup(["daemon", *PEERS], workdir)
    assert r.returncode == 2 and "key 'token_file'" in r.stderr, r.stderr
    short = workdir / "token"
    short.write_text("short\n")
    short.chmod(0o600)
    r = run_rlsup(["daemon", *PEERS, "--token-file", str(short)], workdir)
    assert r.returncode == 2 and str(short) in r.stderr and "Traceback" not in r.stderr, r.stderr


