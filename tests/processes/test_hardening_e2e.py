"""Issue #9: a rank arms die-with-parent (PR_SET_PDEATHSIG) as soon as it imports trainer_hooks under
rlsup, not only at its first heartbeat. Real processes; every wait is a poll with a deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support.env import ROOT, clean_env
from support.procs import pid_alive
from support.waits import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")

PROBE = textwrap.dedent("""
    import ctypes, os, sys
    if len(sys.argv) > 1 and sys.argv[1] == "as-writer":
        sys.orig_argv = [sys.executable, "-m", "trainer_hooks.async_writer", "--fd", "3"]
    import trainer_hooks

    def pdeathsig():
        sig = ctypes.c_int(-1)
        ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
        return sig.value

    at_import = pdeathsig()
    trainer_hooks.heartbeat(1)  # arms again at the first heartbeat: idempotent, the rank lives on
    after_beat = pdeathsig()
    pid = os.fork()
    if pid == 0:  # a forked worker that arms with its own parent (the rank) must not kill itself
        sys.modules["trainer_hooks.heartbeat"]._die_with_parent()  # (the package attribute is the function)
        os._exit(0 if pdeathsig() == 9 else 3)
    _, status = os.waitpid(pid, 0)
    print(at_import, after_beat, os.waitstatus_to_exitcode(status), "torch" in sys.modules, flush=True)
""")


def _probe(tmp_path: Path, under_rlsup: bool, *args: str) -> list[str]:
    env = clean_env()
    env["PYTHONPATH"] = str(ROOT)
    if under_rlsup:
        env["RLSUP_HEARTBEAT_DIR"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_import_arms_die_with_parent_only_under_rlsup(tmp_path: Path) -> None:
    sig = str(int(signal.SIGKILL))
    # Under rlsup: armed at import already, still armed after the first heartbeat, a forked child that
    # arms survives, and the import stays light (no torch).
    assert _probe(tmp_path, True) == [sig, sig, "0", "False"]
    # Outside rlsup nothing is armed (heartbeat is a no-op there).
    assert _probe(tmp_path, False)[:2] == ["0", "0"]
    # The async checkpoint writer arms itself only when its creator is a main thread: not at import.
    assert _probe(tmp_path, True, "as-writer")[0] == "0"


LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]])  # from the main thread, like torchrun
    print(rank.pid, flush=True)
    time.sleep(600)
""")

RANK = textwrap.dedent("""
    import os, sys, time
    import trainer_hooks  # and never a heartbeat: stuck before its first step (rendezvous, data loading)
    open(os.path.join(os.environ["RLSUP_HEARTBEAT_DIR"], "imported"), "w").close()
    time.sleep(600)
""")


@pytest.mark.timeout(120)
def test_rank_that_never_heartbeats_dies_with_its_launcher(tmp_path: Path) -> None:
    env = clean_env()
    env["PYTHONPATH"] = str(ROOT)
    env["RLSUP_HEARTBEAT_DIR"] = str(tmp_path)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK], env=env, stdout=subprocess.PIPE, text=True)
    rank_pid = None
    try:
        rank_pid = int(launcher.stdout.readline())
        wait_for(lambda: (tmp_path / "imported").exists(), 60, "the rank to import trainer_hooks")
        assert pid_alive(rank_pid)
        launcher.kill()  # SIGKILL: the launcher can clean nothing up
        launcher.wait(timeout=30)
        wait_for(lambda: not pid_alive(rank_pid), 20, "the orphaned rank to die with its launcher")
        assert not (tmp_path / "rank_00000.hb").exists()  # it really never heartbeated
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=30)
        launcher.stdout.close()
        if rank_pid is not None and pid_alive(rank_pid):
            os.kill(rank_pid, signal.SIGKILL)
        if rank_pid is not None:
            try:
                os.waitpid(rank_pid, os.WNOHANG)  # reaped here only if this process is a subreaper
            except ChildProcessError:
                pass
