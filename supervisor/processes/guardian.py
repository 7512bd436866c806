"""The guardian: a tiny process per rlsup run that ends the attempt when rlsup dies, however it dies.

PR_SET_PDEATHSIG reaches only the job's root; a SIGKILLed (or OOM-killed) rlsup cannot clean up,
and the root's children would train on, holding their GPUs. The guardian is started once per run
(not per attempt: the restart path pays nothing), in its own session so a signal to rlsup's process
group does not take it too. It holds the read end of a pipe whose write end only rlsup has (close on
exec, so no job process keeps it), and a pidfd of rlsup where the kernel has them: end of file or
the pidfd's readiness means rlsup is gone. It then reads the run's ``attempt_tree.json`` and ends
what it names (:func:`supervisor.processes.leftovers.end_leftovers`), logging to ``attempt_guard.log`` in the
state directory. rlsup ending normally writes ``bye`` first: the guardian exits doing nothing.
Standard library only, so it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlsup_format.state_files import GUARDIAN_LOG
from supervisor.processes.leftovers import end_leftovers
from supervisor.processes.tree_record import load, record_path

BYE = b"bye"
_ROOT = str(Path(__file__).resolve().parents[2])


class Guardian:
    """rlsup's side: the running guardian and the pipe that keeps it waiting."""

    def __init__(self, state_dir: Path) -> None:
        read_end, self._write_end = os.pipe()  # both close-on-exec: no job process inherits them
        code = f"import sys; sys.path.insert(0, {_ROOT!r}); from supervisor.processes.guardian import main; sys.exit(main())"
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-s", "-c", code, "--state-dir", str(state_dir), "--owner", str(os.getpid())],
                stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(read_end)
        self.pid = self.popen.pid

    def close(self) -> None:
        """rlsup ends normally: tell the guardian there is nothing to do, and reap it."""
        try:
            os.write(self._write_end, BYE)
        except OSError:
            pass
        os.close(self._write_end)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def _wait_for_owner(owner: int) -> bool:
    """Block until rlsup is gone (True) or says bye (False)."""
    watch = [sys.stdin.fileno()]
    try:
        pidfd = os.pidfd_open(owner)
        if os.getppid() != owner:  # rlsup died before the pidfd was opened: the pid may be another's
            return True
        watch.append(pidfd)
    except (AttributeError, OSError):
        pass
    said = b""
    while True:
        ready, _, _ = select.select(watch, [], [])
        if sys.stdin.fileno() not in ready:
            return True  # the pidfd: rlsup exited
        chunk = os.read(sys.stdin.fileno(), 64)
        if not chunk:
            return not said.endswith(BYE)
        said = (said + chunk)[-len(BYE):]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlsup-attempt-guard")
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--owner", required=True, type=int)
    args = parser.parse_args(argv)
    for signum in (signal.SIGINT, signal.SIGHUP):  # a terminal's ^C or hang-up is rlsup's to handle
        signal.signal(signum, signal.SIG_IGN)
    if not _wait_for_owner(args.owner):
        return 0
    record = load(record_path(args.state_dir))
    if record is None or record.owner.pid != args.owner:
        return 0
    deadline = time.monotonic() + 10  # the pipe closes while rlsup is still exiting, before it is a zombie
    while record.owner_alive():
        if time.monotonic() > deadline:
            return 0  # alive after all: never end a live rlsup's attempt
        time.sleep(0.01)
    ended = end_leftovers(record)
    try:
        record_path(args.state_dir).unlink()  # done: a successor (days later, pids reused) must not act on it
    except OSError:
        pass
    if ended:
        line = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} rlsup pid {args.owner} is gone; ended " \
               f"{', '.join(map(str, ended))}\n"
        try:
            with open(args.state_dir / GUARDIAN_LOG, "a") as f:
                f.write(line)
        except OSError:
            pass
    return 0
