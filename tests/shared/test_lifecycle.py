"""The lifecycle table: every legal transition accepted, every other one raises, the docstring's
diagram is the table, and the documented reasons/actions/states are the enums (stdlib only, in-process)."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from support.env import ROOT

from supervisor.lifecycle import (ATTEMPT_FAILURES, FINAL, HUNG, TRANSITIONS, Action, EndReason, IllegalTransition,
                                  JobStatus, check_transition, diagram, route)

# TRANSITIONS' values are sets: in enum order, so every pytest-xdist worker collects the same list
LEGAL = [(old, new) for old, nexts in TRANSITIONS.items() for new in sorted(nexts, key=list(JobStatus).index)]
ILLEGAL = [(old, new) for old, new in itertools.product(JobStatus, JobStatus) if new not in TRANSITIONS[old]]


def test_table_covers_every_status() -> None:
    assert set(TRANSITIONS) == set(JobStatus)
    assert FINAL == {JobStatus.SUCCEEDED, JobStatus.GAVE_UP, JobStatus.STOPPED, JobStatus.PREEMPTED}


@pytest.mark.parametrize(("old", "new"), LEGAL, ids=[f"{o.name}->{n.name}" for o, n in LEGAL])
def test_legal_transition_accepted(old: JobStatus, new: JobStatus) -> None:
    assert check_transition(old, new) is new
    assert check_transition(old.value, new.value) is new  # state.json holds plain strings


@pytest.mark.parametrize(("old", "new"), ILLEGAL, ids=[f"{o.name}->{n.name}" for o, n in ILLEGAL])
def test_illegal_transition_raises(old: JobStatus, new: JobStatus) -> None:
    with pytest.raises(IllegalTransition, match=f"{old.name} -> {new.name}"):
        check_transition(old, new)


def test_known_paths() -> None:
    """The paths the old diagram missed, and the ones it forbade."""
    check_transition(JobStatus.STARTING, JobStatus.FAILED)  # abandoned before launch (multi-node)
    check_transition(JobStatus.BACKOFF, JobStatus.STOPPED)  # SIGTERM between attempts
    check_transition(JobStatus.BACKOFF, JobStatus.PREEMPTED)
    for old, new in [(JobStatus.RUNNING, JobStatus.STOPPED), (JobStatus.SUCCEEDED, JobStatus.STARTING),
                     (JobStatus.INIT, JobStatus.RUNNING), (JobStatus.RUNNING, JobStatus.RUNNING)]:
        with pytest.raises(IllegalTransition):
            check_transition(old, new)


def test_every_status_reachable_and_every_path_ends() -> None:
    seen, todo = {JobStatus.INIT}, [JobStatus.INIT]
    while todo:
        for nxt in TRANSITIONS[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    assert seen == set(JobStatus)
    ends = set(FINAL)
    while True:  # statuses from which some final status is reachable
        more = {s for s, nexts in TRANSITIONS.items() if nexts & ends} - ends
        if not more:
            break
        ends |= more
    assert ends == set(JobStatus)


def test_docstring_diagram_is_the_table() -> None:
    doc = JobStatus.__doc__ or ""
    block = doc.split("::", 1)[1].strip("\n").split("\n\n", 1)[0]
    lines = [line.strip() for line in block.splitlines()]
    assert lines == diagram().splitlines(), "JobStatus's docstring diagram disagrees with TRANSITIONS:\n" + diagram()


def test_str_enums_keep_their_strings() -> None:
    for member in [*JobStatus, *EndReason, *Action]:
        assert str(member) == member.value and f"{member}" == member.value and member == member.value
        assert hash(member) == hash(member.value) and member.value in {member}
        assert json.loads(json.dumps({"x": member})) == {"x": member.value}
    assert JobStatus.SUCCEEDED.value in FINAL and "hang" in HUNG


def test_documented_reasons_actions_and_states() -> None:
    readme = (ROOT / "README.md").read_text()
    para = readme[readme.index("An incident's `reason` is one of"):]
    para = para[:para.index("\n- ")]
    documented = set(re.findall(r"`([a-z_]+)`", para))
    for member in [*EndReason, *Action]:
        if member is not EndReason.SUCCESS:  # never an incident: success ends the run
            assert member.value in documented, f"README's incident reasons/actions lack `{member.value}`"
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    restarts = next(line for line in deploy.splitlines() if line.startswith("| `rlsup_restarts_total`"))
    assert set(re.findall(r"[a-z_]+", restarts.split("`reason` =")[1].split("|")[0])) == \
        {r.value for r in ATTEMPT_FAILURES}
    states = next(line for line in deploy.splitlines() if line.startswith("| `rlsup_job_state`"))
    assert states.split("` = ")[1].split(" |")[0].split(", ") == [s.value for s in JobStatus]


@pytest.mark.parametrize("old", list(JobStatus))
def test_route_to_gave_up_is_legal_and_shortest_or_empty(old: JobStatus) -> None:
    path = route(old, JobStatus.GAVE_UP)
    if old in FINAL or old is JobStatus.STOPPING:  # STOPPING ends only as stopped or preempted
        assert path == []
        return
    assert path[-1] is JobStatus.GAVE_UP
    for a, b in zip([old, *path], path):
        check_transition(a, b)
    assert route(JobStatus.STARTING, JobStatus.GAVE_UP) == [JobStatus.FAILED, JobStatus.GAVE_UP]
