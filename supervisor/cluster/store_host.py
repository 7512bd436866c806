"""Which job an embedded coordination store is hosted for: node 0 records it before anyone joins, and every node
refuses a store hosted for another job (two jobs on the same hosts and default port), naming both."""

from __future__ import annotations

import json
import time
from typing import Callable

from supervisor.cluster.round_errors import JobClash
from supervisor.cluster.signed_keys import SignedKeys
from supervisor.job_identity import JobIdentity

HOST_KEY = "rlsup/host"
HOST_POLL_S = 0.05  # how often a node looks for node 0's record while node 0 is binding


def claim_store(keys: SignedKeys, job: JobIdentity) -> None:
    """Node 0 of the embedded store: record which job this store is for (before anyone joins)."""
    keys.store.set(HOST_KEY, keys.seal(HOST_KEY, json.dumps({"job": job.id, "source": job.source})))


def store_holder(keys: SignedKeys, raw: bytes | None) -> str | None:
    """None when ``raw`` (the store's host record) is this job's or absent; else who holds the store."""
    if raw is None or keys.open(HOST_KEY, raw, quiet=True) is not None:
        return None
    try:
        other = json.loads(json.loads(raw.decode().partition(":")[2])["v"])
        return f"rlsup job {other['job']!r} ({other['source']}; or a job signing with another secret)"
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        return "another job (its record does not parse)"


def refuse_other_job(keys: SignedKeys, job: JobIdentity, wait_s: float, check_stop: Callable[[str], None]) -> None:
    """Refuse a store hosted for another job (:class:`JobClash`, naming both); node 0 sets its record right after
    binding the port, so an absent one is looked for up to ``wait_s``."""
    where = keys.store.describe()
    deadline = time.monotonic() + wait_s
    raw = keys.store.get(HOST_KEY)
    while raw is None and time.monotonic() < deadline:
        check_stop(f"node 0 to claim the coordination store {where}")
        time.sleep(HOST_POLL_S)
        raw = keys.store.get(HOST_KEY)
    other = store_holder(keys, raw)
    if other is not None:
        raise clash(where, other, job)


def clash(where: str, other: str, job: JobIdentity) -> JobClash:
    """A node of ``job`` reached the store ``where`` of another job (``other`` names it)."""
    return JobClash(f"the coordination store {where} is hosted for {other}; this node is job {job}. Two jobs on the "
                    "same hosts need their own coordinator_port (and replication ports); the nodes of one job need "
                    "the same job_name or checkpoint_dir")
