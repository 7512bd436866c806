"""The run loop's fake process layer (torch elastic's TestAgent style), shared by the in-process run-loop
tests: :class:`FakeProcesses` hands the loop scripted jobs whose ranks heartbeat into the real heartbeat
directory, so the real :class:`HangDetector`, classification, restart policy, incidents and state table run
as in production (tests/run/test_run_loop.py, test_multinode_loop.py, test_progress.py,
test_unreadable_checkpoints.py). It implements :class:`supervisor.processes.layer.Processes` (and
:class:`FakeJob` its ``Job``) without subclassing the real layer; the loop under test is the real
:class:`Supervisor`, given the fake layer and :func:`saved_steps` as its resume choice."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from rlsup_format.heartbeat_record import MAGIC, RECORD, RECORD_SIZE, STOP_OFFSET, I64, rank_file_name
from supervisor.config import SupervisorConfig
from supervisor.run.incidents import read_incidents
from supervisor.observer import Observer
from supervisor.processes.leftovers import Ended
from supervisor.tiers.resume import ResumePoint
from supervisor.run.loop import Supervisor
from supervisor.run.peers import Peers


@dataclass
class Attempt:
    """One scripted attempt. Each poll of the job is one tick; ranks heartbeat step = tick until
    ``hang_at`` (then silence), the job exits with ``exit_code`` at tick ``exit_at``; ``saves`` is the
    step it checkpoints at tick ``exit_at - 1`` (progress). Asked to stop, it exits with ``stop_exit``."""

    exit_code: int | None = 0
    exit_at: int = 3
    ranks: int = 2
    beats: bool = True
    hang_at: int | None = None
    saves: int | None = None
    oom: bool = False
    dead_rank: int | None = None  # this rank's process dies first (exit_code is the launcher's)
    stop_exit: int | None = 0  # None: ignores the stop request (killed after stop_grace)
    on_tick: tuple[int, object] | None = None  # (tick, callable) run during that poll
    step_base: int = 0  # ranks beat step_base + tick (a trainer that resumed at step_base)


class FakeOutput:
    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        self.finished: str | None = None  # a progress preset's done line (none in these jobs)

    def join(self, timeout: float) -> None:
        pass

    def tail(self) -> list[str]:
        return list(self.lines)


class FakeJob:
    """A scripted attempt: :class:`supervisor.processes.layer.Job`, as the real ``JobProcess`` is."""

    def __init__(self, layer: "FakeProcesses", script: Attempt, env: dict[str, str], pid: int) -> None:
        self.layer, self.script, self.pid = layer, script, pid
        self.hb_dir = Path(env["RLSUP_HEARTBEAT_DIR"])
        self.env = env
        self.tick = 0
        self.code: int | None = None
        self.signals: list[int] = []
        self.grace: float | None = None
        self.stuck: list = []  # nothing of a scripted job outlives its SIGKILL
        self.output = FakeOutput([f"attempt {env['RLSUP_RESTART_COUNT']} output"])

    def rank_pid(self, rank: int) -> int:
        return self.pid + 1 + rank

    def _beat(self, rank: int, step: int, registered_only: bool = False) -> None:
        path = self.hb_dir / rank_file_name(rank)
        stop = I64.unpack_from(path.read_bytes(), STOP_OFFSET)[0] if path.exists() else 0  # rlsup's flag stays
        data = bytearray(RECORD_SIZE)
        now = 0 if registered_only else time.monotonic_ns()
        RECORD.pack_into(data, 0, 2, MAGIC, self.rank_pid(rank), step, now, 0, 0, stop, 0, 0)
        path.write_bytes(bytes(data))

    def stop_requested(self) -> bool:
        for rank in range(self.script.ranks):
            path = self.hb_dir / rank_file_name(rank)
            if path.exists() and I64.unpack_from(path.read_bytes(), STOP_OFFSET)[0]:
                return True
        return bool(self.signals)

    def poll(self) -> int | None:
        if self.code is not None:
            return self.code
        s = self.script
        self.tick += 1
        if s.on_tick is not None and s.on_tick[0] == self.tick:
            s.on_tick[1]()
        if s.beats and (s.hang_at is None or self.tick < s.hang_at):
            for rank in range(s.ranks):
                self._beat(rank, s.step_base + self.tick)
        if s.saves is not None and self.tick == s.exit_at - 1:
            self.layer.checkpoints.append(s.saves)
        if s.exit_code is not None and self.tick >= s.exit_at:
            self.code = s.exit_code
            self.layer.ooms += int(s.oom)
        return self.code

    def refresh(self) -> None:
        pass

    def send(self, sig: int) -> None:
        self.signals.append(sig)

    def wait_exit(self, timeout: float) -> int | None:
        if self.script.stop_exit is not None and self.stop_requested():
            self.code = self.script.stop_exit
            return self.code
        return None

    def terminate_tree(self, grace: float, stuck_after: float = 10.0) -> list[int]:
        self.grace = grace
        alive = self.code is None
        self.code = -signal.SIGKILL if alive else self.code
        return [self.pid] if alive else []


class FakeProcesses:
    """The operating system as the loop sees it (:class:`supervisor.processes.layer.Processes`), scripted: one
    :class:`Attempt` per launch. No predecessor's leftovers, no cgroup, no guardian."""

    def __init__(self, *attempts: Attempt) -> None:
        self.script = list(attempts)
        self.jobs: list[FakeJob] = []
        self.checkpoints: list[int] = []  # steps "saved" by the fake jobs (what choose_resume finds)
        self.ooms = 0
        self.rank_signals: list[tuple[int, int]] = []
        self.live_pids: set[int] = set()

    def start(self, command: Sequence[str], env: dict[str, str], log_path: Path, tail_lines: int) -> FakeJob:
        assert self.script, "the loop launched more attempts than the test scripted"
        job = FakeJob(self, self.script.pop(0), dict(env), 100_000 + 100 * len(self.jobs))
        self.jobs.append(job)
        return job

    def become_subreaper(self) -> bool:
        return True

    def end_predecessor(self, state_dir: Path) -> tuple[int, list[Ended]] | None:
        return None  # no rlsup died before this one in a fake operating system

    def guard_attempts(self, state_dir: Path) -> None:  # no real process to guard (no cgroup, no guardian)
        pass

    def release_attempts(self) -> list[Ended]:
        return []

    def oom_kill_count(self) -> int | None:
        return self.ooms

    def pid_exists(self, pid: int) -> bool:
        if pid in self.live_pids:
            return True
        for job in self.jobs:
            for rank in range(job.script.ranks):
                if job.rank_pid(rank) == pid:
                    return job.code is None and rank != job.script.dead_rank
        return False

    def kill(self, pid: int, sig: int) -> None:
        self.rank_signals.append((pid, sig))

    def alive(self, pid: int) -> bool:  # scripted ranks live as long as their attempt
        return True

    def dump_stacks(self, hb_dir: Path, records: Mapping) -> dict[str, str]:
        return {f"rank {r} pid {rec.pid}": "fake stack" for r, rec in sorted(records.items())}


class Recorder(Observer):
    def __init__(self) -> None:
        self.states: list[str] = []
        self.failures: list[str] = []
        self.on_state: dict[str, object] = {}

    def state(self, state: str) -> None:
        self.states.append(state)
        if state in self.on_state:
            self.on_state.pop(state)()  # type: ignore[operator]

    def attempt_failed(self, reason: str, last_step: int | None) -> None:
        self.failures.append(reason)


def saved_steps(layer: FakeProcesses, checkpoint_dir: Path) -> Callable[[], ResumePoint | None]:
    """The loop's resume choice where the checkpoint directory is the fake layer's list of saved steps (no file
    is read, no metric set)."""

    def choose() -> ResumePoint | None:
        steps = layer.checkpoints
        return ResumePoint(max(steps), checkpoint_dir / f"step_{max(steps)}", "rlsup") if steps else None

    return choose


def make(tmp_path: Path, *attempts: Attempt, peers: Peers | None = None,
         **cfg: object) -> tuple[Supervisor, FakeProcesses, Recorder]:
    """A loop over ``attempts`` with config keys ``cfg``; ``peers``: the job's other nodes (default: none)."""
    settings = dict(checkpoint_dir=str(tmp_path / "ckpt"), state_dir=str(tmp_path / "state"), metrics_port=0,
                    poll_interval=0.005, backoff_initial=0.01, backoff_max=0.02, backoff_jitter=0.0,
                    heartbeat_timeout=0.3, startup_timeout=0.3, warm_launcher=False, kill_grace=3.0,
                    stop_grace=5.0)
    settings.update(cfg)
    layer, recorder = FakeProcesses(*attempts), Recorder()
    config = SupervisorConfig(**settings)
    sup = Supervisor(config, ["train"], observer=recorder, processes=layer, peers=peers,
                     resume_choice=saved_steps(layer, Path(config.resolved().checkpoint_dir)))
    sup.kernel_log = None  # never the host's kernel log: a test that wants one writes a file and sets it
    return sup, layer, recorder


ATTEMPT = ["starting", "running"]


def incidents(tmp_path: Path) -> list[dict]:
    return read_incidents(tmp_path / "state")
