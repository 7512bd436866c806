"""Which job a checkpoint part, replica, inventory, plan or persistent copy belongs to.

Two jobs can share hosts, ports, a token file and working directories; none of those may make them
one. So every part a trainer writes under rlsup carries the job's identity (``RLSUP_JOB_ID``, stamped
into its manifest), replicas live in per-job namespaces (``<job>.node<N>``), persistent copies under
``<persistent_dir>/<job>/``, and the coordination keys under ``rlsup/<job>/``.

The identity comes from, in order:

1. ``job_name`` when set;
2. the scheduler's job id (``SLURM_JOB_ID``: it survives a requeue, so a requeued job resumes its own data);
3. the checkpoint directory: on one node its absolute path; on several nodes the path as written in the
   config together with the peers list, because each node resolves a relative path in its own working
   directory and all nodes of one job must derive the same identity, while two jobs launched alike from
   other directories on the same hosts (same default checkpoint_dir) differ in their peers. Nodes that
   derive different identities never join one job: the coordinator refuses them with both named.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

_SAFE = re.compile(r"[^A-Za-z0-9_-]+")
MAX_LEN = 64


@dataclass(frozen=True)
class JobIdentity:
    """``id`` is safe as a path component and a key prefix (``[A-Za-z0-9][A-Za-z0-9_-]*``, no dots, so
    ``<job>.node<N>`` parses back); ``source`` says where it came from, for messages."""

    id: str
    source: str

    def __str__(self) -> str:
        return f"{self.id} (from {self.source})"


def _slug(text: str, salt: str) -> str:
    """A readable id: the text's safe characters, plus a hash whenever that lost or shortened anything."""
    safe = _SAFE.sub("-", text).strip("-_")[:40]
    if safe == text and safe[:1].isalnum():
        return safe
    digest = hashlib.sha256(f"{salt}\0{text}".encode()).hexdigest()[:12]
    return f"{safe}-{digest}" if safe[:1].isalnum() else f"job-{digest}"


def job_identity(job_name: str, checkpoint_dir: str, multi_node: bool,
                 environ: Mapping[str, str] | None = None, cwd: str | None = None,
                 peers: Sequence[str] = ()) -> JobIdentity:
    """The job's identity (see the module docstring); ``checkpoint_dir`` as configured, not resolved."""
    environ = os.environ if environ is None else environ
    if job_name:
        return JobIdentity(_slug(job_name, "name"), f"job_name {job_name!r}")
    slurm = environ.get("SLURM_JOB_ID", "")
    if slurm:
        return JobIdentity(_slug(f"slurm-{slurm}", "slurm"), f"SLURM_JOB_ID {slurm}")
    if multi_node:
        path = os.path.normpath(checkpoint_dir)
        how = f"checkpoint_dir as written {path!r} and peers {','.join(peers)}"
    else:
        path = os.path.realpath(os.path.join(cwd or os.getcwd(), checkpoint_dir))
        how = f"checkpoint_dir {path!r}"
    base = _SAFE.sub("-", os.path.basename(path.rstrip("/"))).strip("-_")[:40]
    digest = hashlib.sha256("\0".join(["dir", path, *peers]).encode()).hexdigest()[:12]
    return JobIdentity(f"{base}-{digest}" if base[:1].isalnum() else f"job-{digest}", how)


def namespace_of(job: str, node: int) -> str:
    """The replica-store namespace holding ``node``'s parts of ``job``."""
    return f"{job}.node{node}"


def parse_namespace(name: str) -> tuple[str, int] | None:
    """(job, node) of a replica namespace, or None for anything else (another scheme, a stray dir)."""
    job, sep, node = name.rpartition(".node")
    if not sep or not job or not node.isdigit():
        return None
    return job, int(node)
