"""The tests' reference runs (plain torch, never what a test is about) with one ``import torch`` per run instead
of one per torchrun and per rank: a driver process imports what the ranks import, then forks each phase's ranks
with the environment torchrun gives its workers, phase after phase. On the CI's 2 cores a 3-rank torchrun costs
~8 CPU-s before its first step (torchrun's agent and each rank importing torch and torch._dynamo), a forked rank
well under one: the cost of a reference is its steps.

What a test runs under rlsup (or tests the launch of) still runs under real torchrun; only the run a test compares
with comes from here. Its results are the same: the jobs seed everything, and the bit-identical tests compare a
supervised torchrun run with it. One difference from torchrun: no agent hosts the rendezvous store, rank 0 does
(``env://`` without an agent, as ``torch.multiprocessing.spawn`` users run), on a port picked just before the fork.

Run as ``python forked_ranks.py REQUEST`` with a JSON request (:class:`ForkedRun` writes it): the script, the
working directory, and each phase's world size, arguments and log file prefix; exit 0 when every rank of every
phase exited 0, else 1 after the phase that failed (later phases are not run), which it names on stderr.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Sequence

#: What the ranks import first, imported once by the driver before it forks (torch._dynamo: any optimizer's
#: constructor imports it, a second of CPU per process here).
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel")


@dataclass(frozen=True)
class ForkedPhase:
    """One torchrun's worth of ranks: ``world`` ranks of the script with ``args``; rank R's output (stdout and
    stderr) goes to ``<log_prefix>.rank<R>``."""
    world: int
    args: tuple[str, ...]
    log_prefix: str


def run_phases(script: str, phases: Sequence[ForkedPhase], cwd: Path, env: Mapping[str, str],
               timeout: float = 300) -> list[str]:
    """Run ``phases`` one after the other (forked ranks, see the module); returns each phase's output, its ranks'
    in rank order. Raises AssertionError naming the phase and its output when a rank of it fails."""
    return ForkedRun(script, phases, cwd, env).result(timeout)


class ForkedRun:
    """:func:`run_phases` started now, to run alongside what a test runs under rlsup (the two share only the
    cores): :meth:`result` waits for it; :meth:`stop` ends it (a test that failed before it asked)."""

    def __init__(self, script: str, phases: Sequence[ForkedPhase], cwd: Path, env: Mapping[str, str]) -> None:
        self.script, self.phases = script, tuple(phases)
        env = dict(env)
        if any(p.world > 1 for p in phases):  # as torchrun sets it for 2+ local ranks; torch reads it at import
            env.setdefault("OMP_NUM_THREADS", "1")
        request = json.dumps({"script": script, "phases": [asdict(p) for p in phases]})
        self.proc = subprocess.Popen([sys.executable, __file__, request], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd, env=env, text=True,
                                     start_new_session=True)

    def result(self, timeout: float = 300) -> list[str]:
        """Each phase's output, its ranks' in rank order, once the run ended; AssertionError naming the phase and
        its output when a rank of it failed, or with every process's stacks when it is still running at
        ``timeout``."""
        proc, script, phases = self.proc, self.script, self.phases
        try:
            said, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stacks = _stacks(proc.pid)  # where the driver and its ranks wait: what a timeout's report is for
            self.stop()
            said, _ = proc.communicate()
            logs = "".join(f"--- phase {i} ---\n{o[-3000:]}\n" for i, p in enumerate(phases) if (o := _output(p)))
            raise AssertionError(f"forked reference run of {script} still running after {timeout:.0f}s\n"
                                 f"driver said: {said[-2000:]}\n{logs}{stacks}") from None
        outputs = [_output(p) for p in phases]
        if proc.returncode != 0:
            named = re.search(r"^forked_ranks: phase (\d+) failed", said, re.M)
            if named is None:  # the driver failed before a phase (its import, the request)
                raise AssertionError(f"forked reference run of {script} failed before its ranks: {said[-6000:]}")
            failed = int(named.group(1))
            raise AssertionError(f"phase {failed} ({phases[failed].world} ranks, forked): "
                                 f"{(said + (outputs[failed] or ''))[-6000:]}")
        return [o or "" for o in outputs]

    def stop(self) -> None:
        """Kill the driver and its ranks (one stuck in a collective outlives the driver) if still running."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


def _stacks(session: int) -> str:
    """py-spy's dump of each process of ``session`` (the driver's), for a run that hangs."""
    spy = Path(sys.executable).with_name("py-spy")
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session:  # field 6 of stat: the session id
            pids.append(int(stat.parent.name))
    out = []
    for pid in sorted(pids):
        try:
            dump = subprocess.run([str(spy), "dump", "--native", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
            out.append(f"--- stacks of {pid} ---\n{(dump.stdout + dump.stderr)[-3000:]}")
        except (OSError, subprocess.TimeoutExpired) as e:
            out.append(f"--- stacks of {pid}: {e} ---")
    return "\n".join(out)


def _output(phase: ForkedPhase) -> str | None:
    """The phase's ranks' output, None for a phase not run."""
    logs = [Path(f"{phase.log_prefix}.rank{r}") for r in range(phase.world)]
    if not any(p.exists() for p in logs):
        return None
    return "".join(p.read_text(errors="replace") for p in logs if p.exists())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun --standalone sets for its workers (those a job can read), one node."""
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world, "GROUP_RANK": 0,
           "GROUP_WORLD_SIZE": 1, "ROLE_RANK": rank, "ROLE_WORLD_SIZE": world, "ROLE_NAME": "default",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": 0,
           "TORCHELASTIC_MAX_RESTARTS": 0, "TORCHELASTIC_RUN_ID": "forked-reference"}
    return {k: str(v) for k, v in env.items()}


def _run_rank(script: str, args: Sequence[str], env: dict[str, str], log: str) -> None:
    """In the forked child: become the rank (environment, argv, output), run the script, exit as it does."""
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).parent)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)  # as the interpreter prints sys.exit("message")
    except BaseException:  # a rank's crash: its exit code, and its traceback in its log
        import traceback
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # As multiprocessing's forked children end: the interpreter's own exit in a forked child can wait forever on
    # what torch's import started in the driver and the fork did not copy (a reference once hung there in CI).
    # The jobs write what a test reads (weights, checkpoints, id logs) and close it before they return.
    os._exit(code)


def _run_phase(script: str, phase: dict) -> bool:
    """Fork the phase's ranks, wait for all of them; whether every one exited 0 (a failed rank ends the rest: the
    others would wait in a collective for it)."""
    world, port = phase["world"], _free_port()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            try:
                _run_rank(script, phase["args"], _worker_env(rank, world, port), f"{phase['log_prefix']}.rank{rank}")
            finally:
                os._exit(1)  # a child never returns into the driver's loop (it would fork ranks of its own)
        pids.append(pid)
    ok = True
    left = set(pids)
    while left:
        pid, status = os.wait()
        left.discard(pid)
        if os.waitstatus_to_exitcode(status) != 0 and ok:
            ok = False
            for other in left:
                os.kill(other, signal.SIGKILL)
    return ok


def main() -> int:
    request = json.loads(sys.argv[1])
    for name in PRELOAD:
        __import__(name)
    gc.freeze()  # what the ranks inherit is never walked by their collector: no copy of it per rank
    started = time.monotonic()
    for i, phase in enumerate(request["phases"]):
        if not _run_phase(request["script"], phase):
            print(f"forked_ranks: phase {i} failed ({time.monotonic() - started:.1f}s in)", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
