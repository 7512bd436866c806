"""The supervisor's durable record: ``incidents.jsonl`` (one line per failed attempt) and ``state.json``.

Both live in the state directory so ``rlsup status`` (another process) can read them, and so an
operator can reconstruct every restart after the fact.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlsup_format.state_files import INCIDENTS, STATE
from supervisor.lifecycle import Action, EndReason, JobStatus


@dataclass
class Incident:
    """One failed attempt and what followed it."""

    time: float
    attempt: int
    reason: EndReason  # written as its string value; read back (read_incidents) as that string
    exit_code: int | None = None
    signal: str | None = None
    rank: int | None = None
    pid: int | None = None
    detail: str = ""
    output_tail: list[str] = field(default_factory=list)
    stacks: dict[str, str] = field(default_factory=dict)
    last_step: int | None = None
    action: Action = Action.RESTART
    downtime_s: float | None = None
    resumed_from: str | None = None
    resumed_step: int | None = None
    resumed_tier: str | None = None  # local | peer | persistent
    # whether rlsup knows the step the next attempt resumed from (False: steps lost "unknown"); None: no next
    # attempt started after this one (rlsup gave up or stopped): nothing was resumed, no steps were lost to it
    resume_known: bool | None = None
    world: str = ""  # what the next attempt's round did to the job's size ("continued on 2 of 3 nodes from step 6")
    verdict: str = ""  # who to blame, from the grouped stacks (supervisor.diagnosis.stack_groups) or a health check
    fr_verdict: str = ""  # who to blame in a hung collective, from the Flight Recorder (supervisor.diagnosis.flight_recorder)
    suspect_ranks: list[int] = field(default_factory=list)
    suspect_nodes: list[str] = field(default_factory=list)
    # single-file checkpoints found torn after the attempt with no complete version to put back: each
    # {"file", "torn" (what is wrong with it), "no_version" (why none was kept)}
    left_torn: list[dict[str, str]] = field(default_factory=list)


@dataclass
class JobState:
    """What ``rlsup status`` shows about the current or last run."""

    state: JobStatus
    attempt: int
    pid: int
    command: list[str]
    started: float
    updated: float = field(default_factory=time.time)
    job_pid: int | None = None
    last_step: int | None = None
    heartbeat_timeout_s: float | None = None
    heartbeat_timeout_origin: dict[str, Any] | None = None  # how it was reached (hang_detector.TimeoutOrigin)
    resume_step: int | None = None
    resume_dir: str | None = None
    resume_tier: str | None = None
    exit_code: int | None = None
    # several nodes: the nodes the running world spans and the node count the job was launched for (fewer
    # after a shrink, min_nodes); None on a single node
    world_nodes: int | None = None
    job_nodes: int | None = None


def append_incident(state_dir: Path, incident: Incident) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    line = json.dumps(asdict(incident), sort_keys=True) + "\n"
    with open(state_dir / INCIDENTS, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_incidents(state_dir: Path, last: int | None = None) -> list[dict[str, Any]]:
    """Parse incidents.jsonl, skipping a torn last line (rlsup may have been killed mid-write)."""
    path = state_dir / INCIDENTS
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out[-last:] if last else out


def write_state(state_dir: Path, state: JobState) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    state.updated = time.time()
    tmp = state_dir / f".{STATE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(asdict(state), indent=1, sort_keys=True))
    os.replace(tmp, state_dir / STATE)


def publish_state(state_dir: Path, state: JobState) -> None:
    """``write_state`` for updates while the job runs (its step): a full disk is logged, not raised,
    so it never ends the supervision of a running job."""
    try:
        write_state(state_dir, state)
    except OSError as e:
        logging.getLogger("rlsup").warning("state.json not updated: %s", e)


def read_state(state_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((state_dir / STATE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
