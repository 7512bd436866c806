"""In process: how an unkillable attempt is described and classified (supervisor.diagnosis.unkillable), and how calls into
a store that stops answering are bounded (supervisor.bounded_calls, the tiers' PollLoop watchdog). The real
hung mount is tests/run/test_hung_fs_e2e.py's."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from supervisor.diagnosis.outcome import AttemptResult
from supervisor.bounded_calls import BoundedCalls
from supervisor.lifecycle import EXCLUDES_NODE, EndReason
from supervisor.tiers.poll_loop import PollLoop
from supervisor.diagnosis.outcome import unkillable_outcome
from supervisor.diagnosis.unkillable import Mount, StuckProcess, examine, mount_of, mounts, record_stuck, verdict
from support.waits import wait_for

MOUNTINFO = """\
22 1 0:21 / / rw,relatime - overlay overlay rw
30 22 0:25 / /tmp rw,nosuid - tmpfs tmpfs rw
41 30 0:50 / /tmp/job/ckpt rw,nosuid,nodev - fuse.sickfs sickfs rw,user_id=0
42 22 0:51 / /mnt/with\\040space rw - nfs4 server:/export rw
43 22 0:52 / /mnt/données rw - lustre mgs@tcp:/fs rw
"""


def test_mount_table_longest_point_first_and_paths_matched_by_text(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    table = mounts(str(info))
    assert [m.point for m in table][:2] == ["/mnt/with space", "/tmp/job/ckpt"]
    assert mount_of("/tmp/job/ckpt/step_000000004/rank_00000.pt", table) == Mount("/tmp/job/ckpt", "fuse.sickfs",
                                                                                  "sickfs")
    assert mount_of("/tmp/job/ckpt", table).point == "/tmp/job/ckpt"
    assert mount_of("/tmp/job/ckpt2/x", table).point == "/tmp"  # a prefix of the text, not of the path
    assert mount_of("/mnt/with space/a", table).fstype == "nfs4"
    assert mount_of("/mnt/données/step_4", table).fstype == "lustre"  # UTF-8 names are not escaped: kept as read
    assert mount_of("/etc/hosts", table).point == "/"


def stuck(state: str = "D", rank: int | None = 1) -> StuckProcess:
    mount = Mount("/tmp/job/ckpt", "fuse.sickfs", "sickfs")
    return StuckProcess(4242, state, "python", "request_wait_answer", rank, "/tmp/job/ckpt/step_4/rank_1.pt",
                        ["/tmp/job/ckpt/step_4", "/tmp/job/.rlsup/rank_1.hb"], [mount])


def test_verdict_names_the_pid_rank_state_wchan_file_and_mount() -> None:
    line = verdict([stuck(), stuck("S", 0)], 2.0)
    assert line.startswith("1 process unkillable (state D 2s after SIGKILL): rank 1 pid 4242 (python) state D "
                           "in request_wait_answer on /tmp/job/ckpt/step_4/rank_1.pt")
    assert "holding /tmp/job/ckpt/step_4 on" in line and ".hb" not in line  # files on the suspect mount only
    assert line.endswith("; mount /tmp/job/ckpt not answering")


def test_a_process_in_d_turns_the_attempt_unkillable_and_excludes_the_node(tmp_path: Path) -> None:
    said: list[str] = []
    ended = AttemptResult(3, EndReason.SAVE_TIMEOUT, None, detail="rank 1 (pid 4242) silent for 2.1s")
    record = tmp_path / "unkillable.json"
    record_stuck(3, [stuck()], 2.0, said.append, record)
    result = unkillable_outcome(ended, [stuck()], 2.0)
    assert result.reason == EndReason.UNKILLABLE and result.reason in EXCLUDES_NODE
    assert result.detail.endswith("(the attempt had ended: save_timeout: rank 1 (pid 4242) silent for 2.1s)")
    assert (result.rank, result.pid, result.suspect_ranks) == (1, 4242, [1])
    assert ended.reason == EndReason.SAVE_TIMEOUT  # a new outcome: the ending it came from is not rewritten
    (written,) = json.loads(record.read_text())["processes"]
    assert (written["state"], written["mounts"], written["waiting_on"]) == ("D", ["/tmp/job/ckpt"],
                                                                          "/tmp/job/ckpt/step_4/rank_1.pt")
    assert any("no next attempt on this node" in line for line in said)


@pytest.mark.parametrize("ending", [EndReason.SUCCESS, EndReason.STOPPED, EndReason.PREEMPTED])
def test_a_job_that_succeeded_or_was_stopped_keeps_its_ending(tmp_path: Path, ending: EndReason) -> None:
    """A finished job is not requeued elsewhere, and a stop stays a stop (STOPPING -> FAILED is no transition):
    the stuck processes are named and recorded, the ending stands."""
    said: list[str] = []
    result = AttemptResult(2, ending, 0 if ending == EndReason.SUCCESS else None)
    record = tmp_path / "unkillable.json"
    record_stuck(2, [stuck()], 2.0, said.append, record)
    assert unkillable_outcome(result, [stuck()], 2.0) is result and record.is_file()
    assert "a success, stop or preemption stands" in said[0]


def test_alive_but_not_in_d_is_only_logged() -> None:
    said: list[str] = []
    result = AttemptResult(0, EndReason.HANG, None)
    record_stuck(0, [stuck("S")], 2.0, said.append)
    assert unkillable_outcome(result, [stuck("S")], 2.0) is result and "not in state D" in said[0]
    record_stuck(0, [], 2.0, said.append)
    assert unkillable_outcome(result, [], 2.0) is result and len(said) == 1


def test_examine_reads_a_live_process_without_touching_its_files() -> None:
    """This process itself: alive, not in D, its cwd among its files; a gone pid is left out."""
    (me,) = examine([os.getpid()])
    assert me.state in ("R", "S") and not me.uninterruptible and os.getcwd() in me.paths
    assert examine([2 ** 22 + 12345]) == []


def test_bounded_call_returns_the_default_past_its_deadline_and_starts_none_beside_a_blocked_one() -> None:
    calls = BoundedCalls("reading /stuck", 0.2)
    release = threading.Event()
    started: list[int] = []

    def blocked() -> str:
        started.append(1)
        release.wait(30)
        return "late"

    assert calls.call(blocked, "default") == "default" and calls.timeouts == 1
    assert calls.call(blocked, "again") == "again" and len(started) == 1  # none started beside the blocked one
    release.set()
    wait_for(lambda: calls.blocked_since is None, 10, "the blocked call to return")
    assert calls.call(lambda: "quick", "default") == "quick"
    with pytest.raises(ZeroDivisionError):
        calls.call(lambda: 1 / 0, None)


def test_a_call_that_returns_as_its_caller_gives_up_never_leaves_it_blocked() -> None:
    """The worker ends between the caller's wait running out and the caller naming it blocked (the race made
    certain: the caller's progress probe lets the call return and joins its thread before the wait ends)."""
    calls = BoundedCalls("reading /slow", 0.05)
    go = threading.Event()
    worker: list[threading.Thread] = []

    def call() -> str:
        worker.append(threading.current_thread())
        go.wait(30)
        return "late"

    probes: list[int] = []

    def progress() -> int:
        probes.append(1)
        if len(probes) > 1:  # the caller's wait is over: let the call end before the caller names it blocked
            go.set()
            worker[0].join(30)
        return 0

    assert calls.call(call, "default", progress=progress) == "default" and calls.timeouts == 1
    assert calls.blocked_since is None  # it has returned: nothing is blocked
    assert calls.call(lambda: "quick", "default") == "quick"


def test_poll_loop_names_a_stalled_pass_and_stop_does_not_wait_on_it() -> None:
    release = threading.Event()
    named: list[str] = []
    loop = PollLoop(lambda: release.wait(30), "tier", lambda e: None, stall_s=0.2, on_stall=named.append)
    loop.doing = "copying step 4 rank 0 to /mnt/tier"
    loop.start(interval=60)
    wait_for(lambda: named, 10, "the stalled pass named")
    assert "copying step 4 rank 0 to /mnt/tier" in named[0] and loop.stuck() and loop.stalls == 1
    loop.stop(timeout=30)  # returns at once: the pass is named stalled
    assert loop.stuck()
    release.set()
    wait_for(lambda: not loop.stuck(), 10, "the stalled pass to end once released")


class _Counter:
    def __init__(self) -> None:
        self.kept = 0
        self.seen: dict[str, int] = {}


def test_a_forked_call_returns_its_value_its_changes_its_notes_and_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    """run_forked: the value, the named attributes of the owner (the child's memory is its own), the notes and
    the child's log records come back; the child is reaped, and is never a member of a job."""
    import logging

    from supervisor.bounded_calls import child_pids, left_behind, note, run_forked

    owner, notes = _Counter(), []

    def work() -> int:
        owner.kept += 2
        owner.seen["ckpt.pt"] = os.getpid()
        note("copying ckpt.pt")
        logging.getLogger("supervisor.run.file_versions").warning("kept in pid %d", os.getpid())
        return 41 + 1

    with caplog.at_level(logging.INFO):
        assert run_forked(work, "test-pass", owner, ("kept", "seen"), on_note=notes.append) == 42
    child = owner.seen["ckpt.pt"]
    assert owner.kept == 2 and child != os.getpid() and notes == ["copying ckpt.pt"]
    assert f"kept in pid {child}" in caplog.text
    assert child not in child_pids() and left_behind() == []


def test_a_forked_call_raises_what_failed_and_an_unpicklable_value_is_an_error() -> None:
    from supervisor.bounded_calls import ChildCallFailed, run_forked

    def fails() -> None:
        raise FileNotFoundError(2, "No such file", "/ckpt/x")

    with pytest.raises(ChildCallFailed, match="FileNotFoundError"):
        run_forked(fails, "test-pass")
    with pytest.raises(ChildCallFailed, match="not picklable"):
        run_forked(lambda: threading.Lock(), "test-pass")


def test_a_forked_call_whose_child_died_without_an_answer_gives_the_default_not_an_error(
        caplog: pytest.LogCaptureFixture) -> None:
    """A child killed before it answered (the OOM killer, a stray SIGKILL): run_forked says so (ChildLost), and a
    bounded call goes on with its default as past its deadline; a crash of rlsup's loop was the old outcome (seen in
    CI: the launch's checkpoint note under load). Its own exception still reaches the caller."""
    import os
    import signal

    from supervisor.bounded_calls import BoundedCalls, ChildCallFailed, ChildLost, run_forked

    def killed() -> int:
        os.kill(os.getpid(), signal.SIGKILL)
        return 1

    with pytest.raises(ChildLost, match="ended without an answer"):
        run_forked(killed, "test-pass")
    calls = BoundedCalls("reading the test directory", 30.0, forked=True)
    assert calls.call(killed, -1) == -1
    assert "reading the test directory gave no answer" in caplog.text
    with pytest.raises(ChildCallFailed, match="FileNotFoundError"):
        calls.call(lambda: open("/nonexistent/rlsup-test").read(), "")


_FORK_WATCH: list = []  # set while the registration test runs: its at-fork hook (os.register_at_fork stays)


def _after_fork_in_parent() -> None:
    if _FORK_WATCH:
        _FORK_WATCH[0]()


os.register_at_fork(after_in_parent=_after_fork_in_parent)


