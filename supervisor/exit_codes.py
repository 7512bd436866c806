"""Exit codes of ``rlsup run``; documented in the README so batch scripts can act on them."""

OK = 0
FAILED = 1  # restarts exhausted and the job's own code was not usable
CONFIG_ERROR = 2  # bad flag, environment value or config file
REQUEUE = 75  # preempted (or asked to checkpoint and go): the job saved; requeue it (EX_TEMPFAIL)
NO_PROGRESS = 76  # several attempts in a row made no new valid checkpoint: do NOT requeue
UNHEALTHY = 77  # this node failed pre_launch_check: requeue WITHOUT it (<state_dir>/unhealthy_nodes names it)


def from_signal(signum: int) -> int:
    """The shell's convention for 'stopped by signal N'."""
    return 128 + signum
