"""In process: how an unkillable attempt is described and classified (supervisor.diagnosis.unkillable), and how calls into
a store that stops answering are bounded (supervisor.bounded_calls, the tiers' PollLoop watchdog). The real
hung mount is tests/test_hung_fs.py's."""

from __future__ import annotations


import os
import threading


from supervisor.bounded_calls import BoundedCalls
from supervisor.tiers.poll_loop import PollLoop
from support.waits import wait_for
from test_unkillable import _after_fork_in_parent
import json
from pathlib import Path
from test_unkillable import _FORK_WATCH


def test_calls_as_long_as_the_deadline_never_leave_it_blocked() -> None:
    calls = BoundedCalls("reading /slow", 0.002)
    for _ in range(300):
        calls.call(lambda: threading.Event().wait(0.002), None)
        wait_for(lambda: calls.blocked_since is None, 10, "a returned call to leave nothing blocked")


def test_a_new_pass_after_a_stalled_one_is_not_stuck() -> None:
    """The stall line outlives its pass for up to a watchdog tick; the next pass must not read as stuck."""
    releases = [threading.Event(), threading.Event()]
    started: list[int] = []

    def run_pass() -> None:
        started.append(1)
        if len(started) <= len(releases):
            releases[len(started) - 1].wait(30)

    named: list[str] = []
    loop = PollLoop(run_pass, "tier", lambda e: None, stall_s=2.0, on_stall=named.append)
    loop.start(interval=0)
    wait_for(lambda: named, 20, "the first pass named stalled")
    assert loop.stuck()
    releases[0].set()
    wait_for(lambda: len(started) == 2, 10, "the second pass to start")
    assert not loop.stuck()  # the second pass has just started: it is not the stalled one
    releases[1].set()
    loop.stop(timeout=30)


os.register_at_fork(after_in_parent=_after_fork_in_parent)


def test_what_rlsup_leaves_at_exit_is_said_once_and_recorded(tmp_path: Path) -> None:
    """left_at_exit: the recorded stuck processes still alive and the forked calls still there are named in one
    line with their mounts, and written under unkillable.json's ``exit``; nothing left: no line, no record."""
    import subprocess
    import sys

    from supervisor.diagnosis.unkillable import held_threads, left_at_exit, start_time

    said: list[str] = []
    assert left_at_exit(tmp_path, 0, [], said.append) is None and said == []
    assert not (tmp_path / "unkillable.json").exists()
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    reused = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = start_time(rank.pid)
        assert started is not None and started == start_time(rank.pid)
        (tmp_path / "unkillable.json").write_text(json.dumps({"grace_s": 2, "processes": [
            {"pid": rank.pid, "rank": 1, "state": "D", "mounts": ["/ckpt"], "start_time": started},
            {"pid": 2 ** 22 + 7, "rank": 0, "state": "D", "mounts": ["/ckpt"], "start_time": 1},  # gone since
            # its pid now another process's (a later start), or a record without a start time: not named
            {"pid": reused.pid, "rank": 2, "state": "D", "mounts": ["/other"], "start_time": start_time(reused.pid) - 1},
            {"pid": reused.pid, "rank": 3, "state": "D", "mounts": ["/other"]}]}))
        helper = {"pid": rank.pid, "label": "rlsup-file-versions", "doing": "", "state": "S", "wchan": ""}
        left = left_at_exit(tmp_path, 77, [helper], said.append)
    finally:
        for proc in (rank, reused):
            proc.kill()
            proc.wait()
    record = json.loads((tmp_path / "unkillable.json").read_text())
    assert record["exit"] == left and left["code"] == 77 and left["ranks"] == [rank.pid], left
    assert left["mounts"] == ["/ckpt"] and left["helpers"][0]["label"] == "rlsup-file-versions"
    assert record["processes"][0]["pid"] == rank.pid  # the verdict's own record stays
    assert len(said) == 1 and "exit 77: left behind on mount /ckpt" in said[0] and f"rank 1 pid {rank.pid}" in said[0]
    assert "rank 2" not in said[0] and "rank 3" not in said[0]
    # each named with the state it is in: the helper merely busy (S) is not said to be stuck (the rank, alive
    # again in S here, neither); nothing in D, so nothing "not answering"
    assert "state S: busy" in said[0] and "not answering" not in said[0], said[0]
    assert held_threads() == []  # this process: no thread asleep on a shared mount


def test_a_helper_s_files_on_the_kernel_s_own_filesystems_name_no_mount(tmp_path: Path) -> None:
    """A forked call inherits what rlsup had open as it forked (a cgroup file another thread was reading, in a CI
    run): a file on /proc or a cgroup mount never holds a process, so rlsup's exit line and record name no mount
    for it (they named /sys/fs/cgroup/unified beside the hung mount)."""
    import subprocess
    import sys

    from supervisor.diagnosis.unkillable import left_at_exit, mounts

    kernel = [m.point for m in mounts() if m.fstype in ("proc", "cgroup", "cgroup2", "sysfs")]
    assert "/proc" in kernel, kernel
    held = [f"{point}/{name}" for point in kernel for name in ("cgroup.procs", "self/stat")
            if os.path.exists(f"{point}/{name}")]
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "files = [open(p, 'rb') for p in sys.argv[1:]]\n"
                               "print('open', flush=True); time.sleep(60)", *held], stdout=subprocess.PIPE)
    said: list[str] = []
    try:
        assert holder.stdout.readline() == b"open\n"
        helper = {"pid": holder.pid, "label": "rlsup-file-versions", "doing": "", "state": "S", "wchan": ""}
        left = left_at_exit(tmp_path, 77, [helper], said.append)
    finally:
        holder.kill()
        holder.wait()
    assert left is not None and left["helpers"][0]["mounts"] == [] and left["mounts"] == [], left
    assert " on mount" not in said[0], said[0]


def test_a_forked_call_left_behind_does_not_hold_rlsups_output_open() -> None:
    """A child left in a mount outlives rlsup: it must not hold rlsup's stdout and stderr (a ``| tee``, a
    subprocess capture or srun's I/O waits for their EOF). rlsup exits; its pipes reach EOF at once."""
    import signal
    import subprocess
    import sys

    from support.env import ROOT

    script = ("import time\n"
              "from supervisor.bounded_calls import BoundedCalls, left_behind\n"
              "calls = BoundedCalls('reading /ckpt (test)', 0.3, forked=True)\n"
              "assert calls.call(lambda: time.sleep(60), 'default') == 'default'\n"
              "print(left_behind()[0]['pid'], flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        out, _err = proc.communicate(timeout=30)  # EOF on both: nothing else holds them
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _err = proc.communicate()
        raise AssertionError("rlsup's output stayed open after it exited: its forked call holds it") from None
    finally:
        for pid in [int(w) for w in (out or b"").split() if w.isdigit()]:
            try:
                os.kill(pid, signal.SIGKILL)  # the child left behind
            except ProcessLookupError:
                pass
    assert proc.returncode == 0 and out.split(), out


def test_rlsups_exit_is_not_held_by_a_stalled_stderr() -> None:
    """``rlsup run`` has decided its code while one of its log lines is stalled (stderr's reader stopped reading;
    the writing thread holds the logging locks): the exit deadline ends the process with that code all the same
    (it takes no logging lock and waits on no write on the way)."""
    import subprocess
    import sys

    from support.env import ROOT

    script = ("import logging\n"
              "from supervisor import log\nfrom supervisor.cli import main as cli\n"
              "log.configure()\n"
              "cli.EXIT_DEADLINE_S = 0.5\n"
              "cli._end_run(3)\n"
              "logging.getLogger('supervisor.test').warning('x' * 50_000_000)\n")  # nobody reads: never ends
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        code = proc.wait(timeout=30)  # stderr is never read
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("rlsup's exit waited on its stalled stderr") from None
    finally:
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()  # type: ignore[union-attr]
    assert code == 3


def test_a_forked_call_that_never_returns_is_left_behind_named_and_its_thread_is_free() -> None:
    """A forked bounded call past its deadline: the caller goes on with the default, the child stays listed (pid,
    label, what it does) until it ends, and the thread that waited for it only ever read a pipe."""
    import signal
    import time

    from supervisor.bounded_calls import left_behind, note

    calls = BoundedCalls("reading /ckpt (test)", 0.5, forked=True)

    def stuck() -> None:
        note("listing /ckpt")
        time.sleep(60)

    assert calls.call(stuck, "default") == "default" and calls.blocked_since is not None
    left = wait_for(lambda: [h for h in left_behind() if h["label"] == "reading /ckpt (test)"], 10, "the child")
    assert left[0]["doing"] == "listing /ckpt" and left[0]["state"] in ("S", "R"), left
    os.kill(left[0]["pid"], signal.SIGKILL)
    wait_for(lambda: calls.blocked_since is None, 10, "the blocked call to be over once its child ended")
    wait_for(lambda: not [h for h in left_behind() if h["label"] == "reading /ckpt (test)"], 10, "the child reaped")


def test_a_forked_call_is_one_of_rlsups_own_before_anyone_can_list_it() -> None:
    """process_tree takes a child of rlsup's that it did not start for a member of the job unless child_pids()
    names it: the child is registered before any other thread can list it (the fork happens under the lock
    child_pids() takes). Here a thread lists rlsup's children right after the fork, before run_forked goes on."""
    import psutil

    from supervisor.bounded_calls import child_pids, run_forked

    seen: list[tuple[set[int], set[int]]] = []
    listed = threading.Event()

    def look() -> None:
        children = {c.pid for c in psutil.Process().children()}
        seen.append((children, child_pids()))
        listed.set()

    def hook() -> None:
        _FORK_WATCH.clear()
        threading.Thread(target=look, daemon=True).start()
        listed.wait(0.5)  # the forking thread holds on here (where a pid is listed and not yet registered)

    before = {c.pid for c in psutil.Process().children()}
    _FORK_WATCH.append(hook)
    try:
        run_forked(lambda: listed.wait(2), "test-pass")  # the child's copy of ``listed`` is never set: 2 s
    finally:
        _FORK_WATCH.clear()
    wait_for(lambda: seen, 10, "the listing thread")
    children, own = seen[0]
    new = children - before
    assert new and new <= own, (new, own)

