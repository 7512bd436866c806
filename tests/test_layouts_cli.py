"""``rlsup checkpoints list|latest|verify`` through ``python -m supervisor.checkpoints_cli``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rlsup_format.names import parse_reserved

from layout_builders import verl_fsdp_step, write_tracker

from supervisor import checkpoints_cli

ROOT = Path(__file__).resolve().parents[1]


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor.checkpoints_cli", "checkpoints", *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_latest_reports_lying_tracker_and_repairs_it(tmp_path: Path) -> None:
    verl_fsdp_step(tmp_path, 10)
    s20 = verl_fsdp_step(tmp_path, 20)
    (s20 / "actor" / "model_world_size_2_rank_1.pt").unlink()
    p = run("latest", str(tmp_path))
    assert p.returncode == 0
    assert p.stdout.strip().splitlines()[-1] == str(tmp_path / "global_step_10")
    assert "names step 20" in p.stderr
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "20"  # untouched without the flag

    p = run("latest", str(tmp_path), "--repair-tracker")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert (tmp_path / "latest_checkpointed_iteration.txt.rlsup-prev").read_text() == "20"
    assert "rewrote" in p.stderr
    assert not [x for x in tmp_path.iterdir() if x.name.endswith(".tmp") or parse_reserved(x.name)]
    p = run("latest", str(tmp_path))
    assert "tracker" not in p.stderr


def test_latest_exit_1_when_nothing_valid(tmp_path: Path) -> None:
    s = verl_fsdp_step(tmp_path, 10)
    (s / "critic" / "fsdp_config.json").unlink()
    write_tracker(tmp_path, "")
    assert checkpoints_cli.main(["checkpoints", "latest", str(tmp_path)]) == 1
    assert checkpoints_cli.main(["checkpoints", "latest", str(tmp_path / "nope")]) == 1


def test_list_and_json(tmp_path: Path, capsys) -> None:
    verl_fsdp_step(tmp_path, 10)
    s20 = verl_fsdp_step(tmp_path, 20)
    (s20 / "data.pt").unlink()
    assert checkpoints_cli.main(["checkpoints", "list", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "valid" in lines[0] and "INVALID: data.pt missing" in lines[1]
    assert checkpoints_cli.main(["checkpoints", "list", str(tmp_path), "--json", "--layout", "verl"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(d["step"], d["valid"]) for d in data] == [(10, True), (20, False)]
    assert data[0]["size_bytes"] > 0 and data[0]["layout"] == "verl"


def test_verify_exit_codes(tmp_path: Path) -> None:
    good = verl_fsdp_step(tmp_path, 10)
    bad = verl_fsdp_step(tmp_path, 20)
    (bad / "actor" / "extra_state_world_size_2_rank_0.pt").write_bytes(b"PK\x03\x04torn")
    assert run("verify", str(good)).returncode == 0
    p = run("verify", str(bad))
    assert p.returncode == 1 and "extra_state_world_size_2_rank_0.pt" in p.stdout


def test_register_adds_subcommand() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    checkpoints_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["checkpoints", "latest", "/x", "--layout", "megatron"])
    assert args.func is checkpoints_cli.cmd_latest and args.layout == "megatron"
