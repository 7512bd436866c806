"""Shared test helpers: run the real ``rlsup`` CLI in a subprocess and poll with deadlines."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import pytest

ROOT = Path(__file__).resolve().parent.parent
JOBS = Path(__file__).resolve().parent / "jobs"
T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy; fail the test naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (all bound at once, so no duplicates)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def rlsup_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "supervisor.cli", *args]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSUP_")}
    env["PYTHONUNBUFFERED"] = "1"
    env["RLSUP_METRICS_PORT"] = "0"  # tests that scrape pass their own free port
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_rlsup(args: list[str], cwd: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(rlsup_cmd(*args), cwd=cwd, env=clean_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def start_rlsup(args: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(rlsup_cmd(*args), cwd=cwd, env=clean_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def incidents(state_dir: Path) -> list[dict]:
    path = state_dir / "incidents.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
    return True


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


def replica_ns(replica_root: Path, owner: int) -> Path:
    """The replica namespace holding ``owner``'s parts (``<job>.node<owner>``); one job per test dir."""
    found = sorted(replica_root.glob(f"*.node{owner}"))
    assert len(found) <= 1, f"more than one job's replicas of node {owner}: {found}"
    return found[0] if found else replica_root / f"missing.node{owner}"


def job_subdir(persistent_root: Path) -> Path:
    """The job's directory in a persistent tier (``<persistent_dir>/<job>/``); one job per test dir."""
    found = [p for p in persistent_root.iterdir() if p.is_dir()] if persistent_root.is_dir() else []
    assert len(found) <= 1, f"more than one job in {persistent_root}: {found}"
    return found[0] if found else persistent_root / "missing-job"
