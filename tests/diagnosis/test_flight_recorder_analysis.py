"""The Flight Recorder verdict on recorded dumps (tests/data/flight_recorder, real 4-rank gloo hangs made by
its capture.py), the request channel between rlsup and a rank's FR thread, the job's environment and the
metric. In process: torch's analyser runs here as it does in rlsup's child."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import threading
from pathlib import Path
from typing import Iterator

import pytest
from support.metrics import parse, value
from support.waits import wait_for

from rlsup_format.heartbeat_record import fr_dump_name
from supervisor.diagnosis.flight_recorder import Analysis, analyse, collect_dumps, first_failure, job_env, read_dump, request_dumps
from supervisor.cli.metrics import SupervisorMetrics
from trainer_hooks import flight_recorder as rank_side

DATA = Path(__file__).resolve().parents[1] / "data" / "flight_recorder"


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


@pytest.fixture
def listener_stopped() -> Iterator[None]:
    """The rank side's listener is once per process: a test that starts one here ends it, so no later test
    depends on the order they run in."""
    assert rank_side.stop_listener()
    yield
    assert rank_side.stop_listener()


def test_request_reaches_a_listener_through_its_fifo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     listener_stopped: None) -> None:
    """The rank side's real thread and FIFO in this process: a request wakes it, it answers (here: no
    process group, so it says so); a rank with no listener is not waited for."""
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


# ------------------------------------------------------------------------------------------ hostile dumps

EVIL = "__import__('pathlib').Path({!r}).write_text('pwned')"


def test_a_dump_whose_ranks_torch_would_eval_runs_nothing(tmp_path: Path) -> None:
    """torch's analyser literal_evals a group's ``ranks`` and evals a string result: such a group is dropped
    before the analyser sees it (in ``normalise`` and again in ``first_failure``), and nothing runs."""
    target = tmp_path / "pwned"
    dumps = recorded("broadcast_instead")
    for d in dumps.values():
        d["pg_config"]["0"] = {"name": "0", "desc": "default_pg", "ranks": repr(EVIL.format(str(target)))}
        d["rlsup_pg_config"]["0"]["ranks"] = repr(EVIL.format(str(target)))
    verdict = analyse(dumps)
    assert not target.exists()
    assert "#9" in verdict.text, verdict.text  # the entries still give the collective
    # A dump that never went through normalise (another node's, say) is cleaned before torch's builder too.
    raw = {r: {"rank": r, "version": d["version"], "entries": d["entries"],
               "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": repr(EVIL.format(str(target)))}}}
           for r, d in recorded("broadcast_instead").items()}
    with contextlib.suppress(Exception):  # the analyser may reject a dump left with no groups: it must not eval
        first_failure(raw, [])
    assert not target.exists()


def test_a_fifo_in_place_of_a_dump_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / fr_dump_name(3)
    os.mkfifo(fifo)
    answers: list[dict | None] = []
    threading.Thread(target=lambda: answers.append(read_dump(fifo)), daemon=True).start()
    wait_for(lambda: answers, 30, "read_dump of a FIFO to return")  # without O_NONBLOCK it blocks for good
    assert answers == [{"error": f"{fifo} is not a regular file"}]


def test_a_dump_nested_too_deep_is_not_json(tmp_path: Path) -> None:
    (tmp_path / "deep").write_text("[" * 100_000)
    assert read_dump(tmp_path / "deep") == {"error": "dump is not JSON"}


def test_without_the_analyser_child_rlsup_reads_the_entries_itself_and_says_so() -> None:
    """The child could not start: no torch in the supervisor; rlsup's own reading names the rank."""
    dumps = recorded("broadcast_instead")
    run = Analysis.start(dumps, {}, in_child=False)
    run.not_started = "OSError: [Errno 24] Too many open files"
    verdict = run.finish()
    assert verdict.suspects == [2] and verdict.seq == 9, verdict.text
    assert verdict.text.endswith("(torch's analyser not started: OSError: [Errno 24] Too many open files: "
                                 "rlsup's own reading)"), verdict.text
    assert not any("COLLECTIVE_TYPE_MISMATCH" in line for line in verdict.analyser), verdict.analyser


# ------------------------------------------------------------------------------------------ the rank side


def test_gloo_and_nccl_rings_merged_still_name_the_rank() -> None:
    """A job with NCCL and gloo groups has entries in both rings: both are kept, in creation order."""
    dumps = recorded("skipped_in_other_group")
    merged = {}
    for r, d in dumps.items():
        first = {**copy.deepcopy(d), "entries": [e for e in d["entries"] if e["process_group"][0] == "0"]}
        second = {**copy.deepcopy(d), "entries": [e for e in d["entries"] if e["process_group"][0] != "0"],
                  "pg_config": {"1": {"name": "1", "desc": "metrics", "ranks": "[0, 1, 2, 3]"}}}
        merged[r] = rank_side.merge(first, second)
        assert merged[r]["entries"] == sorted(d["entries"], key=lambda e: e["time_created_ns"])
        assert set(merged[r]["pg_config"]) >= {"", "1"}
    assert rank_side.merge({"entries": []}, dumps[0])["entries"] == dumps[0]["entries"]  # one ring holds them
    assert analyse(merged).text == analyse(dumps).text


def test_a_thread_that_cannot_start_is_no_listener(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    listener_stopped: None) -> None:
    """Called from the trainer's heartbeat: a process at its thread limit gets no listener, not an exception."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "10")

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    assert not rank_side.start_listener(tmp_path, 1)
    monkeypatch.undo()
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "10")
    assert rank_side.start_listener(tmp_path, 1)  # nothing left behind: a later start works


def test_a_dump_that_cannot_be_written_answers_why_and_the_listener_lives_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listener_stopped: None) -> None:
    rank_side.write_dump(tmp_path / "absent" / "out")  # nowhere to write even why: nothing raised
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "10")
    assert rank_side.start_listener(tmp_path, 4)
    blocker = tmp_path / (fr_dump_name(4) + ".tmp")
    blocker.mkdir()  # the tmp file cannot be opened
    first = collect_dumps(tmp_path, [4], wait_s=30)
    assert first[4]["error"].startswith("dump not written: IsADirectoryError"), first
    blocker.rmdir()
    second = collect_dumps(tmp_path, [4], wait_s=30)  # the same thread still answers
    assert second == {4: {"error": "torch.distributed is not initialised in this process"}}


def test_a_dump_keeps_its_entries_when_the_groups_cannot_be_listed(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A real one-rank gloo group in this process: process_groups() failing leaves the entries, and says why."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "10")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(2))
        good = rank_side.dump()
        assert good["entries"] and good["rlsup_pg_config"]["0"]["ranks"] == "[0]", good

        def broken() -> list:
            raise RuntimeError("no groups today")

        monkeypatch.setattr(c10d, "_get_all_pg_configs", broken)
        data = rank_side.dump()
    finally:
        dist.destroy_process_group()
    assert data["entries"] and data["rlsup_pg_config"] == {}, data
    assert data["rlsup_pg_config_error"] == "RuntimeError: no groups today"
    json.dumps(data)
