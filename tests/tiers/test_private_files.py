"""supervisor/tiers/private_files.py in process: a file a private-table thread opens is not in the table a fork
copies, and the table's copy of a pipe is closed at once (its reader still sees EOF when the owner closes it)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from supervisor.tiers import private_files


def shared_table_has(path: Path) -> bool:
    """Whether the process's shared descriptor table (the main thread's, which a fork from it copies) has ``path``."""
    for fd in os.listdir(f"/proc/{os.getpid()}/task/{os.getpid()}/fd"):
        try:
            if os.readlink(f"/proc/{os.getpid()}/task/{os.getpid()}/fd/{fd}") == str(path):
                return True
        except OSError:
            continue
    return False


def test_a_file_open_in_a_private_thread_is_not_in_the_shared_table(tmp_path: Path) -> None:
    target = tmp_path / "tier_file"
    opened, release = threading.Event(), threading.Event()

    def hold() -> None:
        with open(target, "wb"):
            opened.set()
            release.wait(30)

    assert private_files.run(lambda: private_files.private()) is True
    thread = threading.Thread(target=lambda: (private_files.enter(), hold()), daemon=True)
    thread.start()
    opened.wait(30)
    try:
        assert not shared_table_has(target)
    finally:
        release.set()
        thread.join(30)
    shared = threading.Thread(target=hold, daemon=True)  # the control: a thread of the shared table
    release.clear()
    opened.clear()
    shared.start()
    opened.wait(30)
    try:
        assert shared_table_has(target)
    finally:
        release.set()
        shared.join(30)


def test_the_private_copy_of_a_pipe_never_holds_its_reader_from_eof() -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)  # a write end still open somewhere reads as BlockingIOError, not a hang
    entered, release = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: (private_files.enter(), entered.set(), release.wait(30)), daemon=True)
    thread.start()
    entered.wait(30)
    try:
        os.close(w)  # the owner closes its end while the private thread still lives
        assert os.read(r, 1) == b""  # EOF at once: no copy of the write end is left open
    finally:
        release.set()
        os.close(r)
        thread.join(30)


def test_run_hands_back_the_value_and_the_error() -> None:
    assert private_files.run(lambda: 41 + 1) == 42
    try:
        private_files.run(lambda: 1 // 0)
    except ZeroDivisionError:
        return
    raise AssertionError("the error did not reach the caller")
