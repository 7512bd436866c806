"""Issue 43's surfaces of a job that runs on fewer nodes than it was launched for, in process: the run record's
``world_nodes`` event writes the two numbers to state.json and tells the real metrics observer
(``rlsup_world_nodes``, ``rlsup_job_nodes`` in its exposition), and ``rlsup status`` (its real command function)
says "nodes: 2 of 3 (shrunk)", "nodes: 3 of 3", or nothing for a single-node run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterator

import pytest
from prometheus_client import generate_latest

from rlsup_format.state_files import STATE
from supervisor.cli.main import build_parser, cmd_status
from supervisor.cli.metrics import SupervisorMetrics
from supervisor.lifecycle import JobStatus
from supervisor.run.record import RunRecord
from support.metrics import parse, value

Status = Callable[..., "tuple[int, str]"]


@pytest.fixture
def status(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Iterator[Status]:
    """``rlsup status --state-dir DIR [--json]`` through its command function: (exit code, stdout)."""
    for var in [v for v in os.environ if v.startswith("RLSUP_")]:
        monkeypatch.delenv(var)

    def call(state_dir: Path, *extra: str) -> tuple[int, str]:
        code = cmd_status(build_parser().parse_args(["status", "--state-dir", str(state_dir), *extra]))
        return code, capsys.readouterr().out

    yield call


def running_record(state_dir: Path, metrics: SupervisorMetrics) -> RunRecord:
    record = RunRecord(state_dir, ["torchrun", "train.py"], metrics, lambda _resume: True)
    record.set_state(JobStatus.STARTING, attempt=1)
    return record


def nodes_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("nodes:")]


def test_world_nodes_are_exported_with_their_help() -> None:
    metrics = SupervisorMetrics(job="j", node="n0")
    text = generate_latest(metrics.registry).decode()
    assert value(parse(text), "rlsup_world_nodes") == 0 and value(parse(text), "rlsup_job_nodes") == 0  # single node
    assert "# HELP rlsup_world_nodes Nodes the job's running world spans" in text, text
    assert "# HELP rlsup_job_nodes Nodes the job was launched for" in text, text
    metrics.world_nodes(2, 3)
    samples = parse(generate_latest(metrics.registry).decode())
    assert value(samples, "rlsup_world_nodes") == 2 and value(samples, "rlsup_job_nodes") == 3
    metrics.world_nodes(3, 3)  # grown back at a later restart
    assert value(parse(generate_latest(metrics.registry).decode()), "rlsup_world_nodes") == 3


def test_a_shrunk_world_is_recorded_exported_and_shown_by_status(tmp_path: Path, status: Status) -> None:
    metrics = SupervisorMetrics(job="j", node="n0")
    record = running_record(tmp_path, metrics)
    record.world_nodes(2, 3)
    written = json.loads((tmp_path / STATE).read_text())
    assert (written["world_nodes"], written["job_nodes"]) == (2, 3)
    samples = parse(generate_latest(metrics.registry).decode())
    assert value(samples, "rlsup_world_nodes") == 2 and value(samples, "rlsup_job_nodes") == 3
    code, out = status(tmp_path)
    assert code == 0 and nodes_lines(out) == ["nodes:     2 of 3 (shrunk)"], out
    code, out = status(tmp_path, "--json")
    job = json.loads(out)["job"]
    assert code == 0 and (job["world_nodes"], job["job_nodes"]) == (2, 3)


def test_a_full_world_is_shown_without_shrunk(tmp_path: Path, status: Status) -> None:
    record = running_record(tmp_path, SupervisorMetrics(job="j", node="n0"))
    record.world_nodes(2, 3)
    record.world_nodes(3, 3)  # the lost node (or a replacement) is back: the next attempt runs on all
    record.set_state(JobStatus.RUNNING, job_pid=1234)  # later writes keep the numbers
    code, out = status(tmp_path)
    assert code == 0 and nodes_lines(out) == ["nodes:     3 of 3"], out


def test_a_single_node_run_shows_no_nodes_line(tmp_path: Path, status: Status) -> None:
    running_record(tmp_path, SupervisorMetrics(job="j", node="n0"))  # no world_nodes: one node
    written = json.loads((tmp_path / STATE).read_text())
    assert written["world_nodes"] is None and written["job_nodes"] is None
    code, out = status(tmp_path)
    assert code == 0 and "job:" in out and nodes_lines(out) == [], out


def test_rlsup_incidents_says_what_the_job_went_on_with() -> None:
    """The failure's incident carries the round's words (recorded by the loop from the job's nodes); ``rlsup
    incidents`` prints them on the incident's line."""
    from supervisor.cli.incidents import incident_line

    line = incident_line({"time": 0, "attempt": 0, "reason": "peer_failure", "action": "restart", "last_step": 7,
                          "resumed_step": 6, "downtime_s": 3.2, "world": "continued on 2 of 3 nodes from step 6"})
    assert "continued on 2 of 3 nodes from step 6" in line and "1 steps lost" in line, line
