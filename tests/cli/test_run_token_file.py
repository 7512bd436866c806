"""``rlsup run`` on a node of several without a usable ``token_file`` is a config error (exit 2) naming the key or
the file, said before anything starts: the command line reads the secret through the transport's one rule
(supervisor/transport/security.py), as the replication service does."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor import exit_codes
from supervisor.cli.main import main


def _run(tmp_path: Path, *flags: str) -> int:
    return main(["run", "--peers", "127.0.0.1:1,127.0.0.1:2", "--node-rank", "1", "--metrics-port", "0",
                 "--state-dir", str(tmp_path / "state"), "--checkpoint-dir", str(tmp_path / "ckpt"), *flags,
                 "--", "python", "-c", "pass"])


def test_no_token_file_is_refused_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert _run(tmp_path) == exit_codes.CONFIG_ERROR
    assert "config error: key 'token_file': replication between nodes needs a shared secret file" in \
        capsys.readouterr().err


def test_a_token_file_others_can_read_is_refused_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    token = tmp_path / "token"
    token.write_bytes(b"0123456789abcdef0123\n")
    token.chmod(0o644)
    assert _run(tmp_path, "--token-file", str(token)) == exit_codes.CONFIG_ERROR
    assert f"config error: token_file {token}: permissions 0644" in capsys.readouterr().err
