"""A stop signal that lands while a stop handler (or the wait it should cut short) runs.

The flaky ``test_sigterm_reaches_job_and_rlsup_exits`` (issue 29): rlsup signalled the job root twice
(its process group, then each process seen), and trainer_hooks' SIGTERM handler was
``lambda *_: event.set()``. Python runs a handler between two bytecodes of the main thread, an earlier
run of the same handler included; on a loaded node the second SIGTERM landed while the first handler
held the Event's lock, the nested handler waited for that lock forever, and the rank never reached
``should_stop()`` again (the stop flag was lost with it): rlsup waited out ``stop_grace``. The stacks
rlsup dumped then read ``Event.set <- handler <- Condition.notify_all <- Event.set <- handler``.
These tests send the signal again at every line a handler (or rlsup's backoff wait) runs, in a child
process with a deadline, so the deadlock is met every time instead of once in hundreds of runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from support.env import ROOT, clean_env
from supervisor.processes import job as process_tree
from supervisor.processes.job import JobProcess

PY = sys.executable

# Re-sends SIGTERM to this process at every trace event met while ``inside(frame)`` is true (capped):
# whichever line holds a lock, a nested handler runs there.
RESEND = textwrap.dedent("""
    import os, signal, sys
    sent = 0

    def resend_while(inside, cap=300):
        def tracer(frame, event, arg):
            global sent
            if not inside(frame):
                return None  # no line events where nothing is resent
            if sent < cap:
                sent += 1
                os.kill(os.getpid(), signal.SIGTERM)
            return tracer
        return tracer
""")


def run_script(body: str, tmp_path: Path, timeout: float = 20) -> str:
    script = tmp_path / "script.py"
    script.write_text(RESEND + textwrap.dedent(body))
    try:
        r = subprocess.run([PY, str(script)], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"deadlocked: a SIGTERM arriving while a handler ran was never acted on ({e.stdout!r})")
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_trainer_stop_handler_survives_sigterm_at_every_line_of_itself(tmp_path: Path) -> None:
    out = run_script("""
        import trainer_hooks
        assert not trainer_hooks.should_stop()  # installs the stop handlers
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler), handler

        def in_handler(frame):
            while frame is not None:
                if frame.f_code is handler.__code__:
                    return True
                frame = frame.f_back
            return False

        sys.settrace(resend_while(in_handler))
        os.kill(os.getpid(), signal.SIGTERM)
        stopped = trainer_hooks.should_stop()
        sys.settrace(None)
        print(f"stopped={stopped} resent={sent}")
    """, tmp_path)
    assert "stopped=True" in out, out
    assert int(out.split("resent=")[1]) >= 2, out  # the handler was re-entered, not only run once


def test_rlsup_stop_handler_survives_sigterm_inside_its_backoff_wait(tmp_path: Path) -> None:
    """rlsup's own handler ran ``Event.set`` on the Event its main thread waits on between attempts
    (a signal during ``Event.wait``'s locked lines deadlocked rlsup); it must stop within the backoff."""
    out = run_script(f"""
        import threading, time
        sys.path.insert(0, {str(ROOT)!r})
        from supervisor.config import SupervisorConfig
        from supervisor.run.loop import Supervisor

        cfg = SupervisorConfig(checkpoint_dir="ckpt", state_dir="state", metrics_port=0, poll_interval=0.02,
                               backoff_initial=30.0, backoff_max=30.0, backoff_jitter=0.0, warm_launcher=False,
                               kill_grace=2.0, stop_grace=5.0)
        sup = Supervisor(cfg, [sys.executable, "-c", "import sys; sys.exit(3)"])
        waits = {{threading.Event.wait.__code__, threading.Condition.wait.__code__}}

        def in_backoff_wait(frame):
            return sup.state.state.value == "backoff" and frame.f_code in waits

        sys.settrace(resend_while(in_backoff_wait))
        t0 = time.monotonic()
        result = sup.run()
        sys.settrace(None)
        print(f"exit={{result.exit_code}} attempts={{result.attempts}} resent={{sent}} took={{time.monotonic() - t0:.1f}}")
    """, tmp_path)
    fields = dict(kv.split("=") for kv in out.split())
    assert fields["exit"] == str(128 + signal.SIGTERM), out
    assert int(fields["resent"]) >= 2 and float(fields["took"]) < 20, out  # the 30 s backoff was cut short


def test_send_reaches_each_job_process_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The group signal reaches the root and its children; only a process that left the group (its own
    session) is signalled by pid. Twice to one process is how the trainer's handler got re-entered."""
    pidfile = tmp_path / "moved.pid"
    code = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
            "time.sleep(60)\n")
    others = {c.pid for c in psutil.Process().children()}  # other tests' servers: this process's, not the job's
    job = JobProcess([PY, "-c", code], clean_env(), tmp_path / "out.log", 10)
    try:
        deadline = time.monotonic() + 20
        while not (pidfile.exists() and pidfile.read_text()) or len(psutil.Process(job.pid).children()) < 2:
            assert time.monotonic() < deadline, "the job's children did not start"
            time.sleep(0.02)
        moved = int(pidfile.read_text())
        sent: list[tuple[str, int, int]] = []
        monkeypatch.setattr(JobProcess, "helpers", JobProcess.helpers | others)  # as rlsup's own helpers are
        monkeypatch.setattr(process_tree.os, "killpg", lambda pgid, sig: sent.append(("group", pgid, sig)))
        monkeypatch.setattr(psutil.Process, "send_signal", lambda self, sig: sent.append(("pid", self.pid, sig)))
        job.send(signal.SIGTERM)
        monkeypatch.undo()
        assert sent == [("group", job.pgid, signal.SIGTERM), ("pid", moved, signal.SIGTERM)], sent
    finally:
        job.terminate_tree(0.0)
        try:
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass
