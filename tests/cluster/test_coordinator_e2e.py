"""The end-to-end half of test_coordinator.py (real processes, or waits on real time): attempt coordination through
a real embedded store, and the resume plan across nodes' inventories."""

from __future__ import annotations


import pytest

from supervisor.tiers.holdings import NodeInventory
from supervisor.cluster.round_errors import CoordinationError
from support.ports import free_port
from test_coordinator import node





def test_missing_node_times_out_naming_it() -> None:
    leader = node(free_port(), 0, timeout_s=0.5)
    leader.publish_inventory(0, NodeInventory(0))
    with pytest.raises(CoordinationError, match="inv/0/1"):
        leader.inventories(0)


# ------------------------------------------------------------------------ the persistent tier as a holder


# ------------------------------------------------------------------------ job identity and a lost node 0


# ------------------------------------------------------------------------ values that do not parse


