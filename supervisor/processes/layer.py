"""The process layer: what the run loop asks of the operating system, as typed Protocols.

:class:`Processes` is every call the loop and its watch make on processes (start an attempt's job root, look at and
signal pids, count OOM kills, collect stacks, guard the attempts against rlsup's own death); :class:`Job` is one
started attempt as they see it. The real ones are :class:`supervisor.processes.job.OsProcesses` and
:class:`~supervisor.processes.job.JobProcess`; the in-process tests of the loop pass their own
(tests/support/fake_run_loop.py ``FakeProcesses``), as torch elastic's TestAgent fakes its worker layer. Neither
subclasses the other: each implements the protocol.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

if TYPE_CHECKING:
    from rlsup_format.heartbeat_record import HeartbeatRecord
    from supervisor.diagnosis.unkillable import StuckProcess
    from supervisor.processes.leftovers import Ended


class JobOutput(Protocol):
    """What the loop reads of a job's output: its last lines (incidents), the line in which the trainer said it is
    done (None: not said), and the end of the relay."""

    finished: str | None

    def tail(self) -> list[str]: ...

    def join(self, timeout: float) -> None: ...


class Job(Protocol):
    """One started attempt: its top process, its output, and the calls that watch and end its whole tree."""

    pid: int
    output: JobOutput
    stuck: "list[StuckProcess]"  # alive after SIGKILL and its wait (terminate_tree): evidence for the outcome

    def poll(self) -> int | None:
        """The top process's exit code, or None while it runs."""
        ...

    def refresh(self) -> None:
        """Remember every live member of the tree (called every poll)."""
        ...

    def send(self, sig: int) -> None:
        """Signal the whole tree once."""
        ...

    def wait_exit(self, timeout: float) -> int | None:
        """The top process's exit code once it exits within ``timeout``; None if it did not."""
        ...

    def terminate_tree(self, grace: float, stuck_after: float = 10.0) -> list[int]:
        """End the whole tree (SIGTERM and ``grace``, or SIGKILL at once for 0); the pids that needed SIGKILL."""
        ...


class Processes(Protocol):
    """Everything the run loop (:class:`supervisor.run.loop.Supervisor`) and its watch
    (:class:`supervisor.run.attempt_watch.AttemptWatch`) do to processes."""

    def start(self, command: Sequence[str], env: dict[str, str], log_path: Path, tail_lines: int) -> Job:
        """Start an attempt's job root, its output relayed and logged to ``log_path``."""
        ...

    def become_subreaper(self) -> bool:
        """Orphaned descendants are re-parented to rlsup instead of init; False where that is not possible."""
        ...

    def end_predecessor(self, state_dir: Path) -> "tuple[int, list[Ended]] | None":
        """End what a dead rlsup's attempt left in ``state_dir``: (its pid, what was ended); None: nothing to end."""
        ...

    def guard_attempts(self, state_dir: Path) -> None:
        """From now on the job's trees are recorded in ``state_dir`` and ended if rlsup dies (once per run)."""
        ...

    def release_attempts(self) -> "list[Ended]":
        """The run is over: end anything still recorded and drop the guard; what was ended."""
        ...

    def oom_kill_count(self) -> int | None:
        """The host's count of OOM kills (None: not known); a rise during an attempt marks an OOM."""
        ...

    def pid_exists(self, pid: int) -> bool: ...

    def alive(self, pid: int) -> bool:
        """Whether a registered rank's process still exists (an exited rank is never 'silent')."""
        ...

    def kill(self, pid: int, sig: int) -> None:
        """Signal one registered rank; a rank already gone is not an error."""
        ...

    def dump_stacks(self, hb_dir: Path, records: "Mapping[int, HeartbeatRecord]") -> dict[str, str]:
        """``{"rank R pid P": stack text}`` for every rank of ``records``."""
        ...
