"""supervisor/processes/children.py: the job's tree read from the kernel's per-thread ``children`` files gives what
psutil's scan of every process gives (the watch uses it every poll), children forked by any thread included."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import psutil
import pytest

from supervisor.processes import children as proc_children
from support.waits import wait_for

pytestmark = pytest.mark.skipif(not proc_children.AVAILABLE, reason="this kernel has no /proc/PID/task/TID/children")

# A parent with a child that has a child of its own (a grandchild), all sleeping.
TREE = ("import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import subprocess, sys, time; "
        "subprocess.Popen([\"sleep\", \"60\"]); time.sleep(60)'])\n"
        "time.sleep(60)\n")


def test_descendants_match_psutil_for_a_three_level_tree() -> None:
    root = subprocess.Popen([sys.executable, "-c", TREE])
    try:
        wait_for(lambda: len(psutil.Process(root.pid).children(recursive=True)) == 2, 30, "the tree to be up")
        expected = sorted(p.pid for p in psutil.Process(root.pid).children(recursive=True))
        assert sorted(proc_children.descendants(root.pid) or []) == expected
        assert proc_children.children(root.pid) == [psutil.Process(root.pid).children()[0].pid]
    finally:
        for p in psutil.Process(root.pid).children(recursive=True):
            p.kill()
        root.kill()
        root.wait()


def test_children_forked_by_another_thread_are_found_and_a_gone_pid_has_none() -> None:
    started: list[subprocess.Popen] = []
    done = threading.Event()

    def fork_and_stay() -> None:  # the thread lives on: its child is listed under this thread, not the main one
        started.append(subprocess.Popen(["sleep", "60"]))
        done.wait(60)

    t = threading.Thread(target=fork_and_stay)
    t.start()
    try:
        wait_for(lambda: started, 30, "the thread's child")
        assert started[0].pid in (proc_children.children(os.getpid()) or [])
        assert started[0].pid in (proc_children.descendants(os.getpid()) or [])
    finally:
        done.set()
        t.join()
        started[0].kill()
        started[0].wait()
    assert started[0].pid not in (proc_children.children(os.getpid()) or [])
    assert proc_children.children(started[0].pid) == [] and proc_children.descendants(started[0].pid) == []
