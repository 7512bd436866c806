"""Exit codes of ``rlsup run``; documented in the README so batch scripts can act on them."""

# OK, from any node, means the job succeeded (the SLURM recipe answers 0 for the job once one node exited 0): also a
# node back after a spare ran its rank to the end, or an idle spare, each only once it saw this run finish
# (supervisor.cluster.spares); an idle spare that saw every node stop without that exits FAILED, which requeues nothing.
OK = 0  # the job succeeded
FAILED = 1  # restarts exhausted and the job's own code was not usable (a signal, a hang, or one of ours below)
CONFIG_ERROR = 2  # bad flag, environment value or config file
REQUEUE = 75  # preempted (or asked to checkpoint and go): the job saved; requeue it (EX_TEMPFAIL)
NO_PROGRESS = 76  # several attempts in a row made no progress (supervisor.run.progress_rule): do NOT requeue
UNHEALTHY = 77  # this node failed pre_launch_check: requeue WITHOUT it (<state_dir>/unhealthy_nodes names it)

# rlsup's own answers in 1..125: a job exiting with one of them must not be read as rlsup saying it
# (a trainer's own 75 would requeue forever, its argparse 2 would read as rlsup's config error).
RESERVED = frozenset({CONFIG_ERROR, REQUEUE, NO_PROGRESS, UNHEALTHY})


def from_signal(signum: int) -> int:
    """The shell's convention for 'stopped by signal N'."""
    return 128 + signum


def for_job_code(code: int | None) -> int:
    """rlsup's exit code when it ends on the job's own ``code``: the code itself when it is 1..125 and not
    one of :data:`RESERVED`; FAILED otherwise (a signal, a hang, 126+ or a code that means something
    else from rlsup). The job's real code stays in the last log line and the incident."""
    return code if code is not None and 0 < code < 126 and code not in RESERVED else FAILED
