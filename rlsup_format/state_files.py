"""The names of what rlsup keeps in its state directory (``state_dir``), and where an attempt's directory is.

Each file is written by one part of rlsup and read by another (the CLI, the guardian, the next run, the batch
script), so its name is spelled here once. Here and not in ``supervisor``: the writers and readers sit in
several of its layers, down to the process layer and the diagnosis, and the ranks are told the directory
(:data:`rlsup_format.job_env.STATE_DIR`). Names only: the formats belong to the modules named beside each.
"""

from __future__ import annotations

from pathlib import Path

#: One JSON line per ended attempt (:mod:`supervisor.run.incidents`); read by ``rlsup incidents`` and ``status``.
INCIDENTS = "incidents.jsonl"
#: The job's state now, rewritten on every change (:mod:`supervisor.run.incidents`); read by ``rlsup status``.
STATE = "state.json"
#: One JSON line per straggler report (:mod:`supervisor.diagnosis.stragglers`); read by ``rlsup incidents``.
STRAGGLERS = "stragglers.jsonl"
#: The step intervals the ``auto`` heartbeat timeout learned, kept across rlsup runs of the same command
#: (:mod:`supervisor.diagnosis.hang_detector`).
LEARNED_TIMEOUT = "heartbeat_timeout.json"
#: The processes SIGKILL could not end (:mod:`supervisor.diagnosis.unkillable`); the next run checks them first.
UNKILLABLE = "unkillable.json"
#: Every pid of the running attempt, with its start time (:mod:`supervisor.processes.tree_record`); read by the
#: guardian (:mod:`supervisor.processes.guardian`) when rlsup itself is gone.
ATTEMPT_TREE = "attempt_tree.json"
#: The guardian's own log (:mod:`supervisor.processes.guardian`).
GUARDIAN_LOG = "attempt_guard.log"
#: Node names that failed their check, one per line, appended (:mod:`supervisor.run.node_health`); read by
#: ``deploy/slurm/rlsup.sbatch`` to requeue without them.
UNHEALTHY_NODES = "unhealthy_nodes"
#: The replication engine's state (:class:`supervisor.tiers.replication.ReplicationEngine`, started by
#: :mod:`supervisor.cluster.node_service`); read by ``rlsup status``.
REPLICATION = "replication.json"
#: The running ``rlsup daemon``'s address and pid (:mod:`supervisor.cluster.node_service`).
DAEMON = "daemon.json"
#: The lock one ``rlsup run`` holds on its state directory (:class:`supervisor.cluster.dir_lock.DirLock`).
RUN_LOCK = "run.lock"

#: The attempts' directories, ``attempts/attempt_0003``: see :func:`attempt_path`.
ATTEMPTS = "attempts"
ATTEMPT_GLOB = "attempt_*"
#: In an attempt's directory: the ranks' heartbeat files (:data:`rlsup_format.job_env.HEARTBEAT_DIR`).
HEARTBEATS = "heartbeats"
#: In an attempt's directory: the job's output.
OUTPUT_LOG = "output.log"
#: In an attempt's heartbeat directory: a warm-started rank's record of the rank it became (pid, RANK, LOCAL_RANK),
#: ``{pid}`` its pid. Written by ``supervisor/launch/warm_rank.py`` (which runs without rlsup installed and so spells
#: it by hand: tests/project/test_house_rules.py keeps the two equal), read by :func:`supervisor.diagnosis.stacks.tree_roles`.
WARM_RANK_RECORD = "warm_rank.{pid}.json"


def attempt_path(state_dir: str | Path, attempt: int) -> Path:
    """Where attempt ``attempt`` keeps its output and heartbeats (it may not exist, or no longer: only the
    newest few are kept). :meth:`supervisor.run.record.RunRecord.attempt_dir` makes it fresh."""
    return Path(state_dir) / ATTEMPTS / f"attempt_{attempt:04d}"
