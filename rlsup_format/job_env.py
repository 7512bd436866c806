"""The ``RLSUP_*`` environment variables: rlsup sets them in every attempt's environment, the ranks read them.

Both sides import the names from here (``trainer_hooks`` cannot import ``supervisor``), so a renamed variable
cannot leave one side reading what the other no longer sets. The run loop (:mod:`supervisor.run.loop`) sets
them unless another setter is named. Two files that run without rlsup installed (the warm launcher's
``supervisor/launch/warm_rank.py`` and ``warm_pool.py``, loaded by path under the job's ``sys.path``) spell
their names by hand, each with a comment naming the constant here. The config's own ``RLSUP_<KEY>``
variables (:data:`supervisor.config.ENV_PREFIX`) are settings read by rlsup, not part of this contract.
"""

from __future__ import annotations

#: The attempt number (0 for the first; the ``a<N>`` of rlsup's log lines and the incidents).
RESTART_COUNT = "RLSUP_RESTART_COUNT"
#: The job's checkpoint directory; the default directory of ``trainer_hooks.checkpoint.CheckpointManager``.
CHECKPOINT_DIR = "RLSUP_CHECKPOINT_DIR"
#: This attempt's heartbeat directory (one record per rank, :mod:`rlsup_format.heartbeat_record`); set: under rlsup.
HEARTBEAT_DIR = "RLSUP_HEARTBEAT_DIR"
#: rlsup's state directory (incidents, state.json, the attempts' directories: :mod:`rlsup_format.state_dir`).
STATE_DIR = "RLSUP_STATE_DIR"
#: The signal name (``SIGUSR1``) a scheduler's preemption notice arrives as: ranks save and stop on it.
PREEMPT_SIGNAL = "RLSUP_PREEMPT_SIGNAL"
#: The job's identity (:mod:`supervisor.job_identity`), written into every manifest: a part is never another job's.
JOB_ID = "RLSUP_JOB_ID"
#: The step directory (or file) every rank must resume from, empty for "start fresh"; unset with ``resume: false``.
RESUME_DIR = "RLSUP_RESUME_DIR"
#: The step number of :data:`RESUME_DIR`, when it has one.
RESUME_STEP = "RLSUP_RESUME_STEP"
#: The job's memory-tier directory on this node (set by :meth:`supervisor.tiers.memory_tier.MemoryTier.env`).
MEMORY_DIR = "RLSUP_MEMORY_DIR"
#: How many steps the memory tier keeps (set by the memory tier, like :data:`MEMORY_DIR`).
MEMORY_KEEP_LAST = "RLSUP_MEMORY_KEEP_LAST"
#: The memory tier's byte limit, 0 for none (set by the memory tier, like :data:`MEMORY_DIR`).
MEMORY_LIMIT_BYTES = "RLSUP_MEMORY_LIMIT_BYTES"
#: This node's rank in a multi-node job (set by :mod:`supervisor.cluster.multinode`; unset: one node).
NODE_RANK = "RLSUP_NODE_RANK"
#: The number of nodes in a multi-node job (set by :mod:`supervisor.cluster.multinode`).
NUM_NODES = "RLSUP_NUM_NODES"

#: The world size (ranks) of the step rlsup resumes from, set only when this attempt's world size differs (the job
#: shrank or grew); :func:`trainer_hooks.world.previous_world_size` reads it.
PREVIOUS_WORLD_SIZE = "RLSUP_PREVIOUS_WORLD_SIZE"
