"""The Flight Recorder verdict on recorded dumps (tests/data/flight_recorder, real 4-rank gloo hangs made by
its capture.py), the request channel between rlsup and a rank's FR thread, the job's environment and the
metric. In process: torch's analyser runs here as it does in rlsup's child."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.metrics import parse, value

from rlsup_format.heartbeat_record import fr_dump_name
from supervisor.flight_recorder import analyse, collect_dumps, job_env, read_dump, request_dumps
from supervisor.metrics import SupervisorMetrics

DATA = Path(__file__).parent / "data" / "flight_recorder"


def recorded(case: str) -> dict[int, dict]:
    dumps = {}
    for r in range(4):
        data = read_dump(DATA / case / fr_dump_name(r))
        assert data is not None and "error" not in data, (case, r)
        dumps[r] = data
    return dumps


def test_rank_in_another_op_is_named_with_the_collective() -> None:
    verdict = analyse(recorded("broadcast_instead"), {r: "n1" for r in range(4)})
    assert verdict.text == ("flight recorder: ranks 0, 1, 3 wait in all_reduce #9 (process group 0 default_pg, "
                            "size 4); rank 2 last completed #8 and is in broadcast #9: suspect rank 2 on node n1")
    assert (verdict.suspects, verdict.seq, verdict.op) == ([2], 9, "all_reduce")
    # torch's own analyser found it (its report is kept), not only rlsup's grouping
    assert any("COLLECTIVE_TYPE_MISMATCH" in line for line in verdict.analyser), verdict.analyser


def test_rank_that_skipped_into_another_group_is_named() -> None:
    verdict = analyse(recorded("skipped_in_other_group"), {r: "n1" for r in range(4)})
    assert verdict.text == ("flight recorder: ranks 0, 1, 3 wait in all_reduce #4 (process group 0 default_pg, "
                            "size 4); rank 2 last completed #3 and never called #4 (it waits in all_reduce #4 of "
                            "process group 1 metrics): suspect rank 2 on node n1")
    assert verdict.suspects == [2]
    assert any("missing ranks: {2}" in line for line in verdict.analyser), verdict.analyser


def test_odd_rank_first_is_still_the_suspect() -> None:
    """torch's analyser matches against the first rank's entries: when that rank is the odd one out it
    calls the others culprits. The verdict groups by what each rank does and blames the minority."""
    dumps = recorded("broadcast_instead")
    swapped = {0: dumps[2], 2: dumps[0], 1: dumps[1], 3: dumps[3]}
    swapped[0]["rlsup_rank"], swapped[2]["rlsup_rank"] = 0, 2
    verdict = analyse(swapped)
    assert verdict.suspects == [0] and "rank 0 last completed #8 and is in broadcast #9" in verdict.text


def test_analyser_rejecting_the_input_falls_back_and_says_so() -> None:
    dumps = recorded("broadcast_instead")
    dumps[3]["version"] = "9.9"  # torch's check_version refuses mixed versions
    verdict = analyse(dumps)
    assert verdict.suspects == [2] and "#9" in verdict.text
    assert any(line.startswith("torch's analyser failed") for line in verdict.analyser), verdict.analyser


def test_no_suspect_when_every_rank_is_in_the_same_collective() -> None:
    dumps = recorded("skipped_in_other_group")
    for d in dumps.values():  # every rank's history up to the skip: #1-#3 both groups, then all in #4
        d["entries"] = [e for e in d["entries"] if e["collective_seq_id"] <= 3 or e["process_group"][0] == "0"]
    dumps[2]["entries"].append({**dumps[0]["entries"][-1]})
    verdict = analyse(dumps)
    assert verdict.suspects == [] and "which matches on every rank: no rank to blame" in verdict.text, verdict.text


def test_dumps_that_are_errors_give_no_suspect() -> None:
    verdict = analyse({0: {"error": "torch.distributed is not initialised in this process"}})
    assert verdict.suspects == [] and "no dumps (rank 0: torch.distributed is not initialised" in verdict.text


def test_read_dump_refuses_links_and_garbage(tmp_path: Path) -> None:
    (tmp_path / "garbage").write_text("{not json")
    assert read_dump(tmp_path / "garbage") == {"error": "dump is not JSON"}
    os.symlink(DATA / "broadcast_instead" / fr_dump_name(0), tmp_path / "link")
    assert read_dump(tmp_path / "link") is None and read_dump(tmp_path / "absent") is None


def test_job_env_turns_fr_on_unless_the_user_sized_it() -> None:
    assert job_env({}) == {"TORCH_FR_BUFFER_SIZE": "2000"}
    assert job_env({"TORCH_FR_BUFFER_SIZE": "0"}) == {}  # the user's opt-out stands
    assert job_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"}) == {}


def test_request_reaches_a_listener_through_its_fifo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank side's real thread and FIFO in this process: a request wakes it, it answers (here: no
    process group, so it says so); a rank with no listener is not waited for."""
    from trainer_hooks import flight_recorder as rank_side

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "10")
    assert rank_side.start_listener(tmp_path, 5)
    assert not rank_side.start_listener(tmp_path, 5)  # once per process
    dumps = collect_dumps(tmp_path, [5, 6], wait_s=30)
    assert dumps == {5: {"error": "torch.distributed is not initialised in this process"}}
    assert request_dumps(tmp_path, [6]) == []  # no FIFO: nobody to ask
    (tmp_path / "rank_00007.frreq").write_text("")  # not a FIFO: never opened for writing
    assert request_dumps(tmp_path, [7]) == []


def test_metric_carries_the_suspect_rank() -> None:
    from prometheus_client import generate_latest

    m = SupervisorMetrics(node="n1")
    samples = parse(generate_latest(m.registry).decode())
    assert value(samples, "rlsup_flight_recorder_suspect_rank") == -1
    assert value(samples, "rlsup_suspect_total", node="n1", why="flight_recorder") == 0
    m.flight_recorder([2])
    m.suspect("n1", "flight_recorder")
    samples = parse(generate_latest(m.registry).decode())
    assert value(samples, "rlsup_flight_recorder_suspect_rank") == 2
    assert value(samples, "rlsup_suspect_total", node="n1", why="flight_recorder") == 1


def test_a_verdict_from_some_ranks_says_which() -> None:
    """Multi-node, each node reads its own ranks' dumps: the verdict says whose it saw."""
    dumps = recorded("broadcast_instead")
    verdict = analyse({r: dumps[r] for r in (2, 3)})
    assert verdict.suspects == [] and "suspect" not in verdict.text, verdict.text  # one of two is no minority
    assert verdict.text.endswith("(from ranks 2, 3 only: no dump of ranks 0, 1)"), verdict.text
    verdict = analyse({r: dumps[r] for r in (0, 1)})
    assert verdict.suspects == [] and "no rank to blame" not in verdict.text, verdict.text
