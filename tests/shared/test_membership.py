"""Membership: SLURM hostlist expansion (as `scontrol show hostnames`), peers, ring placement."""

from __future__ import annotations

import pytest

from supervisor.membership import MembershipError, expand_hostlist, from_config, replica_targets


@pytest.mark.parametrize("nodelist,expected", [
    ("node1", ["node1"]),
    ("gpu[01-03,7]", ["gpu01", "gpu02", "gpu03", "gpu7"]),
    ("a[1-2],b3,c[09-10]", ["a1", "a2", "b3", "c09", "c10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("host-[008-010]", ["host-008", "host-009", "host-010"]),
])
def test_expand_hostlist(nodelist: str, expected: list[str]) -> None:
    assert expand_hostlist(nodelist) == expected


@pytest.mark.parametrize("bad", ["gpu[1-2", "gpu]1", "gpu[3-1]", "gpu[a-b]"])
def test_bad_hostlist_names_the_problem(bad: str) -> None:
    with pytest.raises(MembershipError, match="hostlist"):
        expand_hostlist(bad)


def test_membership_from_slurm_environment() -> None:
    env = {"SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_JOB_NUM_NODES": "3", "SLURM_NODEID": "2"}
    m = from_config([], None, 9779, env)
    assert m is not None and m.peers == ("gpu01:9779", "gpu02:9779", "gpu03:9779") and m.me == "gpu03:9779"


def test_membership_explicit_and_errors() -> None:
    m = from_config(["127.0.0.1:7001", "127.0.0.1:7002"], 1, 9779, {})
    assert m is not None and m.me == "127.0.0.1:7002"
    assert from_config([], None, 9779, {}) is None
    with pytest.raises(MembershipError, match="node_rank 5"):
        from_config(["a:1", "b:2"], 5, 9779, {})
    with pytest.raises(MembershipError, match="node_rank is not"):
        from_config(["a:1", "b:2"], None, 9779, {})
    with pytest.raises(MembershipError, match="duplicates"):
        from_config(["a:1", "a:1"], 0, 9779, {})


def test_ring_placement_with_jump() -> None:
    assert replica_targets(0, 4, 1) == [1]
    assert replica_targets(3, 4, 2) == [0, 1]
    assert replica_targets(0, 16, 2, jump=8) == [8, 9]  # copies in the other rack
    assert replica_targets(0, 4, 0) == []
    with pytest.raises(MembershipError):
        replica_targets(0, 2, 2)
    for node in range(6):  # every node's copies land on distinct other nodes
        t = replica_targets(node, 6, 3, jump=2)
        assert node not in t and len(set(t)) == 3
