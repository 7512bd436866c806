"""Processes in tests: the rlsup CLI in a subprocess, whether a pid still lives, freezing, killing."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlsup_format import fileio
from support.env import PY, clean_env
from support.waits import Deadline, wait_for


def rlsup_cmd(*args: str) -> list[str]:
    """The real ``rlsup`` CLI of this checkout, run by this interpreter."""
    return [PY, "-m", "supervisor.cli.main", *args]


def run_rlsup(args: list[str], cwd: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """Run ``rlsup ARGS`` in ``cwd`` to its end (output captured as text), ``env`` over :func:`clean_env`."""
    return subprocess.run(rlsup_cmd(*args), cwd=cwd, env=clean_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def start_rlsup(args: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    """Start ``rlsup ARGS`` in ``cwd``, stdout and stderr together on one text pipe."""
    return subprocess.Popen(rlsup_cmd(*args), cwd=cwd, env=clean_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def proc_state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` (R, S, T, Z, ...), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0]  # the command may itself hold ")"
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    """rlsup's own liveness rule (a pid we may not signal is alive), and not a zombie: a zombie is dead for
    our purposes."""
    return fileio.pid_alive(pid) and proc_state(pid) not in ("Z", "X", None)


def freeze(pid: int, timeout: float = 5.0) -> bool:
    """SIGSTOP ``pid`` and wait until it is stopped; False when it is gone."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return False
    try:
        wait_for(lambda: proc_state(pid) in ("T", "t", "Z", "X", None), timeout, f"pid {pid} to stop", interval=0.001)
    except Deadline:
        # Still inside a syscall (an fsync on a busy disk): the SIGSTOP stays pending and would stop it later,
        # with nobody left to thaw it (a writer stopped after its write looks like a hang to rlsup).
        thaw(pid)
        return False
    if proc_state(pid) in ("T", "t"):
        return True
    thaw(pid)
    return False


@contextmanager
def promptly() -> Iterator[bool]:
    """Run the calling thread at real-time priority (``SCHED_FIFO``) for the block; yields whether it does.

    Why: a fault injector that lets a frozen victim run in slices of 0.3 ms (SIGCONT, sleep, SIGSTOP) to catch
    a window of a few ms sleeps a scheduler tick or more on a loaded machine, and the victim runs through the
    window unseen (a plan's fault then lands too late, or never). A real-time sleeper is woken on time. Where
    the scheduler is not ours to set (no CAP_SYS_NICE), the block runs as it is."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (OSError, AttributeError):
        yield False
        return
    try:
        yield True
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def thaw(pid: int) -> None:
    """SIGCONT ``pid`` (gone already: nothing to do)."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def sigkill(pid: int) -> bool:
    """SIGKILL ``pid``; False when it was already gone."""
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and every descendant at once (a lost node): returns the pids killed."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    return [p.pid for p in procs]


def kill_and_reap(proc: subprocess.Popen, timeout: float | None = 30) -> None:
    """SIGKILL ``proc`` if it still runs, then wait for it (no zombie left behind)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=timeout)


def processes_naming(*markers: str) -> list[int]:
    """Pids of the processes with an argument that contains one of ``markers`` (a test's directories: what is
    left of its jobs)."""
    import psutil

    pids = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(m in arg for arg in (p.info["cmdline"] or []) for m in markers):
                pids.append(p.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return pids
