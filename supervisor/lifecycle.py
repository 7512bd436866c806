"""The job's lifecycle as one table, and the closed vocabularies of attempt end reasons and actions.

Standard library only (like supervisord's ``states.py``): ``rlsup status``, metrics and the docs
can import it without the run loop. Every state change of a run (the run loop's, through
:meth:`supervisor.run.record.RunRecord.set_state`) goes through :func:`check_transition`; a change the
table does not list raises :class:`IllegalTransition`, so a new path through the loop has to be added
here, on purpose.
"""

from __future__ import annotations

from enum import Enum


class _Value(str, Enum):
    """A str enum whose str() and format() are its value on every Python (3.10's ``str, Enum`` mixin
    formats as the value but str()s as ``Class.MEMBER``), and that equals and hashes as its value:
    JSON, metric labels, log lines and ``state.json`` keep the plain strings they always had."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str.__str__(self), spec)

    def __hash__(self) -> int:  # Enum hashes the name: a plain "running" would never be found in a set
        return str.__hash__(self)


class JobStatus(_Value):
    """Lifecycle of a supervised job; :data:`TRANSITIONS` is the rule, this diagram is checked against it::

        INIT      -> STARTING
        STARTING  -> RUNNING | FAILED | RESIZING | STOPPED | PREEMPTED
        RUNNING   -> FAILED | RESIZING | STOPPING | SUCCEEDED
        FAILED    -> BACKOFF | GAVE_UP
        RESIZING  -> STARTING | STOPPED | PREEMPTED
        BACKOFF   -> STARTING | STOPPED | PREEMPTED
        STOPPING  -> STOPPED | PREEMPTED
        SUCCEEDED (final)
        GAVE_UP   (final)
        STOPPED   (final)
        PREEMPTED (final)

    STARTING -> FAILED: the attempt was abandoned before launch (another node ended the round, or this
    node failed its pre_launch_check).
    RUNNING -> FAILED: the job exited non-zero, died by a signal, hung, or another node failed.
    FAILED -> GAVE_UP: retries exhausted, a fatal exit code, too many attempts without progress, or an
    unhealthy node.
    RUNNING -> STOPPING: rlsup got SIGTERM/SIGINT or the preemption signal while the job ran; the job
    gets ``stop_grace`` to save and exit. BACKOFF -> STOPPED | PREEMPTED: the same, between attempts;
    STARTING -> STOPPED | PREEMPTED: the same before launch (in a wait for the other nodes).
    RUNNING | STARTING -> RESIZING: node 0 ended the attempt at a save to grow the job back to its nodes (issue 43);
    no failure: the next attempt starts at once.
    """

    INIT = "init"
    STARTING = "starting"
    RUNNING = "running"
    FAILED = "failed"
    RESIZING = "resizing"
    BACKOFF = "backoff"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    GAVE_UP = "gave_up"
    STOPPED = "stopped"
    PREEMPTED = "preempted"


S = JobStatus
TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    S.INIT: frozenset({S.STARTING}),
    S.STARTING: frozenset({S.RUNNING, S.FAILED, S.RESIZING, S.STOPPED, S.PREEMPTED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.RESIZING, S.STOPPING}),
    S.RESIZING: frozenset({S.STARTING, S.STOPPED, S.PREEMPTED}),
    S.FAILED: frozenset({S.BACKOFF, S.GAVE_UP}),
    S.BACKOFF: frozenset({S.STARTING, S.STOPPED, S.PREEMPTED}),
    S.STOPPING: frozenset({S.STOPPED, S.PREEMPTED}),
    S.SUCCEEDED: frozenset(),
    S.GAVE_UP: frozenset(),
    S.STOPPED: frozenset(),
    S.PREEMPTED: frozenset(),
}
del S

FINAL = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)


def route(old: JobStatus, new: JobStatus) -> list[JobStatus]:
    """The shortest chain of legal transitions from ``old`` to ``new`` (``new`` last; empty when ``old`` is
    ``new`` or ``new`` cannot be reached): for a run that ends from wherever it stood (a coordination
    failure can come in a join, before launch, or between attempts)."""
    paths: dict[JobStatus, list[JobStatus]] = {old: []}
    frontier = [old]
    while frontier and new not in paths:
        nxt = []
        for state in frontier:
            for following in sorted(TRANSITIONS[state], key=list(JobStatus).index):
                if following not in paths:
                    paths[following] = [*paths[state], following]
                    nxt.append(following)
        frontier = nxt
    return paths.get(new, [])


class IllegalTransition(RuntimeError):
    """A state change the lifecycle table does not allow (a bug in the loop, never an input error)."""

    def __init__(self, old: JobStatus, new: JobStatus) -> None:
        allowed = " | ".join(s.name for s in JobStatus if s in TRANSITIONS[old]) or "nothing (final)"
        super().__init__(f"illegal job state transition {old.name} -> {new.name} (allowed: {allowed})")
        self.old, self.new = old, new


def check_transition(old: JobStatus | str, new: JobStatus | str) -> JobStatus:
    """``new`` as a :class:`JobStatus` when the table allows ``old -> new``; raise IllegalTransition otherwise."""
    old, new = JobStatus(old), JobStatus(new)
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(old, new)
    return new


def diagram() -> str:
    """The table rendered as the lines of :class:`JobStatus`'s docstring (a test compares them)."""
    width = max(len(s.name) for s in JobStatus)
    lines = []
    for old in JobStatus:
        nxt = [s.name for s in JobStatus if s in TRANSITIONS[old]]
        lines.append(f"{old.name:<{width}} -> {' | '.join(nxt)}" if nxt else f"{old.name:<{width}} (final)")
    return "\n".join(lines)


class EndReason(_Value):
    """Why an attempt ended (``AttemptResult.reason``, an incident's ``reason``, the ``reason`` metric label)."""

    SUCCESS = "success"  # exit 0
    EXIT_CODE = "exit_code"  # non-zero exit
    SIGNAL = "signal"  # the job (or the torchrun worker that failed first) died by a signal
    OOM = "oom"  # SIGKILL while the kernel's OOM-kill count rose
    HANG = "hang"  # a rank silent past the heartbeat timeout; stacks dumped
    # no rank reported a step within startup_timeout of launch, or a rank's first step after the launch or a
    # restore outlasted it (the incident's detail says which)
    STARTUP_TIMEOUT = "startup_timeout"
    SAVE_TIMEOUT = "save_timeout"  # a rank in a save/load section (or its exit) past save_timeout
    STRAGGLER = "straggler"  # a rank stayed straggler_factor slower than its peers (straggler_action: restart)
    PEER_FAILURE = "peer_failure"  # another node ended the attempt (multi-node)
    STOPPED = "stopped"  # rlsup got SIGTERM/SIGINT
    PREEMPTED = "preempted"  # rlsup got the preemption signal
    SUPERVISOR_LOST = "supervisor_lost"  # a previous rlsup died while the job ran; found at start
    UNHEALTHY = "unhealthy"  # this node failed pre_launch_check; nothing was launched
    # GPU-era failures, told apart by their text (supervisor.diagnosis.gpu_failures):
    CUDA_OOM = "cuda_oom"  # torch.OutOfMemoryError / "CUDA out of memory": restarted like any failure
    NCCL_ERROR = "nccl_error"  # an NCCL error, or the watchdog's collective timeout: restarted
    CUDA_ERROR = "cuda_error"  # another CUDA error (illegal memory access, device-side assert): restarted
    GPU_LOST = "gpu_lost"  # uncorrectable ECC, fallen off the bus, device lost, a hardware Xid: exit 77
    UNKILLABLE = "unkillable"  # a process of the attempt in state D after SIGKILL (a hung mount): exit 77
    # node 0 ended a smaller world's attempt at a save so that a node that came back joins the next one (issue 43):
    # not a failure; the next attempt starts at once and the restart policy does not count it
    RESIZED = "resized"


# Reasons a launched (or abandoned) attempt fails with: each one is a restart candidate and a
# pre-created ``rlsup_restarts_total{reason}`` series.
ATTEMPT_FAILURES: tuple[EndReason, ...] = (
    EndReason.EXIT_CODE, EndReason.SIGNAL, EndReason.OOM, EndReason.HANG, EndReason.STARTUP_TIMEOUT,
    EndReason.SAVE_TIMEOUT, EndReason.STRAGGLER, EndReason.PEER_FAILURE, EndReason.CUDA_OOM, EndReason.NCCL_ERROR,
    EndReason.CUDA_ERROR, EndReason.GPU_LOST, EndReason.UNKILLABLE)
# Reasons whose attempt is killed without kill_grace (stacks already saved; a stuck rank would not act).
HUNG = frozenset({EndReason.HANG, EndReason.STARTUP_TIMEOUT, EndReason.SAVE_TIMEOUT})
# Reasons that say this node's hardware is broken: no restart here; rlsup records the node in
# ``unhealthy_nodes`` and exits UNHEALTHY (77) for a requeue without it, as a failed pre_launch_check does.
# UNKILLABLE: the attempt cannot be torn down (supervisor.diagnosis.unkillable); a next one would run beside it.
EXCLUDES_NODE = frozenset({EndReason.GPU_LOST, EndReason.UNKILLABLE})


class Action(_Value):
    """What rlsup did after an attempt ended (an incident's ``action``)."""

    RESTART = "restart"  # backoff, then the next attempt
    GIVE_UP = "give_up"  # max_restarts used up within restart_window
    FATAL = "fatal"  # the exit code is one of fatal_exit_codes
    NO_PROGRESS = "no_progress"  # max_no_progress_attempts in a row without a newer valid checkpoint
    STOP = "stop"  # rlsup was stopped or preempted
    EXCLUDE_NODE = "exclude_node"  # the node failed its health check or lost a GPU: stop, requeue without it


__all__ = ["JobStatus", "TRANSITIONS", "FINAL", "IllegalTransition", "check_transition", "diagram", "EndReason",
           "ATTEMPT_FAILURES", "HUNG", "EXCLUDES_NODE", "Action"]
