"""One node name for every metric label, incident and exclude list (issue 42): on a SLURM node whose
``SLURMD_NODENAME`` is not its host name, the series pre-created at zero and the increments the run loop
makes carry the same ``node`` label."""

from __future__ import annotations

import socket

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.cli.metrics import SupervisorMetrics
from supervisor.membership import node_name
from supervisor.run import loop


def _suspect_series(metrics: SupervisorMetrics) -> dict[tuple[str, str], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.labels["node"], s.labels["why"]): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "rlsup_suspect_total"}


def test_metrics_and_the_loop_use_the_schedulers_node_name(monkeypatch: pytest.MonkeyPatch) -> None:
    slurm_name = f"slurm-{socket.gethostname()}-17"
    monkeypatch.setenv("SLURMD_NODENAME", slurm_name)
    assert node_name() == slurm_name
    assert loop.node_name is node_name  # the run loop names this node (incidents, suspects) the same way
    metrics = SupervisorMetrics(job="j")
    metrics.suspect(node_name(), "health")  # what the loop does for a failed pre-launch check
    series = _suspect_series(metrics)
    assert {node for node, _ in series} == {slurm_name}, series  # no second label set under the host name
    assert series[(slurm_name, "health")] == 1 and series[(slurm_name, "stacks")] == 0
    info = [s for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode())
            for s in fam.samples if s.name == "rlsup_info"]
    assert info[0].labels["node"] == slurm_name
