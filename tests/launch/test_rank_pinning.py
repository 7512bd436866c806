"""Launch lines as users type them, pinned to rlsup's node rank (torchrun's static rendezvous); the
end-to-end proof that ranks then resume from their own parts is tests/cluster/test_multinode_e2e.py (c10d)."""

from __future__ import annotations

import pytest

from supervisor.launch.rank_pinning import FT_LAUNCHER_NOTE, PinningError, pin_ranks

SCRIPT = ["train.py", "--steps", "5", "--node-rank", "7"]  # the script's own arguments are never touched


def options(command: list[str]) -> dict[str, str]:
    head = command.index("train.py")
    opts, i = {}, 1 if command[0] == "torchrun" else 3
    while i < head:
        opts[command[i]] = command[i + 1] if i + 1 < head and not command[i + 1].startswith("--") else ""
        i += 2 if opts[command[i]] else 1
    return opts


@pytest.mark.parametrize("launcher", [["torchrun"], ["python3", "-m", "torch.distributed.run"]])
def test_c10d_becomes_static_at_rlsup_node_rank(launcher: list[str]) -> None:
    typed = [*launcher, "--nnodes", "3", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", "n0:29400", "--rdzv-id", "job7", *SCRIPT]
    pinned = pin_ranks(typed, 2, 3, "n0")
    assert pinned.command[:len(launcher)] == launcher and pinned.command[-len(SCRIPT):] == SCRIPT
    assert options(pinned.command) == {"--nproc-per-node": "8", "--nnodes": "3", "--node-rank": "2",
                                       "--rdzv-backend": "static", "--master-addr": "n0", "--master-port": "29400"}
    assert "was c10d" in pinned.note and "--rdzv-endpoint" in pinned.note


def test_equals_forms_underscores_and_defaults() -> None:
    pinned = pin_ranks(["torchrun", "--nnodes=1:4", "--rdzv_backend=c10d", "--rdzv_endpoint=n0",
                        "--nproc_per_node=2", *SCRIPT], 1, 2, "head")
    assert options(pinned.command) == {"--nproc_per_node=2": "", "--nnodes": "2", "--node-rank": "1",
                                       "--rdzv-backend": "static", "--master-addr": "head", "--master-port": "29400"}


def test_static_keeps_the_users_master_and_fixes_a_wrong_node_rank() -> None:
    typed = ["torchrun", "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.5", "--master-port", "1234",
             *SCRIPT]
    pinned = pin_ranks(typed, 1, 2, "n0")
    assert options(pinned.command)["--master-addr"] == "10.0.0.5" and options(pinned.command)["--node-rank"] == "1"
    assert "--node-rank 1" in pinned.note
    right = pin_ranks(["torchrun", "--nnodes", "2", "--node-rank", "1", "--master-addr", "n0", "--master-port",
                       "29500", *SCRIPT], 1, 2, "n0")
    assert right.note == ""  # nothing to change, nothing said


def test_other_commands_run_as_typed_and_ft_launcher_warns() -> None:
    assert pin_ranks(["python", "train.py"], 1, 2, "n0").command == ["python", "train.py"]
    ft = ["ft_launcher", "--rdzv-backend", "c10d", "--nnodes", "2", "train.py"]
    pinned = pin_ranks(ft, 1, 2, "n0")
    assert pinned.command == ft and pinned.note == FT_LAUNCHER_NOTE


def test_nnodes_that_cannot_hold_the_peers_is_refused() -> None:
    with pytest.raises(PinningError, match="--nnodes 2 does not admit the 3 nodes"):
        pin_ranks(["torchrun", "--nnodes", "2", *SCRIPT], 0, 3, "n0")


def test_the_option_tables_match_the_installed_torchruns_parser() -> None:
    """rank_pinning reads a launch line without importing torch (a node's supervisor never does): its tables of
    torchrun's options must hold every option of the installed torch's parser, each with its arity."""
    from torch.distributed.run import get_args_parser

    from supervisor.launch.rank_pinning import TORCHRUN_FLAGS, TORCHRUN_VALUE_OPTIONS

    for action in get_args_parser()._actions:
        for option in action.option_strings:
            table = TORCHRUN_FLAGS if action.nargs == 0 else TORCHRUN_VALUE_OPTIONS
            assert option in table, f"torchrun's {option} is not in rank_pinning's table of its options"
    assert not TORCHRUN_FLAGS & TORCHRUN_VALUE_OPTIONS
