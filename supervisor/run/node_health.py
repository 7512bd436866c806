"""Node health before launch: the site's own check (``pre_launch_check``), run before every attempt.

A restart that lands on a broken node fails again and costs the whole job each round (NVRx runs
health checks before its rendezvous for the same reason). rlsup does not guess what "healthy" means
on a site: it runs the command the site names (``nvidia-smi``, ``dcgmi diag -r 1``, a filesystem
probe), with a timeout, and a non-zero exit or a timeout marks this node unhealthy: the run stops
with :data:`supervisor.exit_codes.UNHEALTHY` and the node's name is recorded in
``<state_dir>/unhealthy_nodes`` so the batch script can requeue with ``--exclude``. The value
``builtin`` (:data:`BUILTIN`) runs rlsup's own NVML check instead (:mod:`supervisor.diagnosis.gpu_health`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from rlsup_format.state_files import UNHEALTHY_NODES
from supervisor.diagnosis.evidence import AttemptEvidence, HealthFailed
from supervisor.diagnosis.outcome import AttemptResult, classify
from supervisor.run.incidents import Incident
from supervisor.lifecycle import ATTEMPT_FAILURES, EndReason

REPEATS_MAKE_SUSPECT = 2  # a node whose own attempts failed this often in one run is named
OUTPUT_TAIL = 4000
BUILTIN = "builtin"  # pre_launch_check's value for rlsup's own NVML check (supervisor/diagnosis/gpu_health.py)
log = logging.getLogger(__name__)


@dataclass
class HealthResult:
    """One run of the check: whether it passed, and what it said."""

    ok: bool
    detail: str
    seconds: float
    output: str = ""


def run_check(command: str, timeout: float, env: dict[str, str] | None = None) -> HealthResult:
    """Run ``command`` through the shell (sites write pipelines); pass = exit 0 within ``timeout``."""
    start = time.monotonic()
    try:
        proc = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=timeout, env=env,
                              stdin=subprocess.DEVNULL, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") if isinstance(e.stdout, bytes) else (e.stdout or "")
        text = out.decode(errors="replace") if isinstance(out, bytes) else out
        return HealthResult(False, f"pre_launch_check timed out after {timeout:.0f}s: {command}",
                            time.monotonic() - start, text[-OUTPUT_TAIL:])
    except OSError as e:
        return HealthResult(False, f"pre_launch_check could not run ({e}): {command}", time.monotonic() - start)
    output = (proc.stdout + proc.stderr)[-OUTPUT_TAIL:]
    if proc.returncode != 0:
        last = output.strip().splitlines()[-1] if output.strip() else "no output"
        return HealthResult(False, f"pre_launch_check exited {proc.returncode} ({last}): {command}",
                            time.monotonic() - start, output)
    return HealthResult(True, "passed", time.monotonic() - start, output)


def run_builtin(launch: Sequence[str], timeout: float) -> HealthResult:
    """rlsup's NVML check (:func:`supervisor.diagnosis.gpu_health.check_gpus`), for the job ``launch`` starts."""
    import threading

    from supervisor.diagnosis.gpu_health import GpuHealth, check_gpus

    box: list[GpuHealth | Exception] = []

    def run() -> None:
        try:
            box.append(check_gpus(launch))
        except Exception as e:  # noqa: BLE001 - an NVML binding too old or odd: said, as a failed check
            box.append(e)

    # A hung driver can hang an NVML call (as it hangs nvidia-smi): the check waits at most ``timeout``.
    worker = threading.Thread(target=run, name="rlsup-gpu-health", daemon=True)
    worker.start()
    worker.join(timeout)
    if not box:
        return HealthResult(False, f"pre_launch_check builtin timed out after {timeout:.0f}s (NVML did not "
                                   "answer: a GPU or the driver may be hung)", timeout)
    gpus = box[0]
    if isinstance(gpus, Exception):
        return HealthResult(False, f"pre_launch_check builtin failed ({type(gpus).__name__}: {gpus})", 0.0)
    detail = gpus.detail if gpus.ok else f"pre_launch_check builtin: {gpus.detail}"
    return HealthResult(gpus.ok, detail, gpus.seconds, "\n".join(gpus.reasons))


def check_node(command: str, timeout: float, attempt: int, node: str,
               launch: Sequence[str] = ()) -> AttemptResult | None:
    """The failed attempt an unhealthy node makes (nothing launched), or None (healthy, or no check set).
    ``launch`` is the job's command (the builtin check reads how many GPUs it asks for)."""
    if not command:
        return None
    if command.strip() == BUILTIN:
        result = run_builtin(launch, timeout)
        if result.ok:
            log.info(f"attempt {attempt}: pre_launch_check builtin: {result.detail} ({result.seconds:.3f}s)")
    else:
        result = run_check(command, timeout)
    if result.ok:
        return None
    return classify(AttemptEvidence(attempt, HealthFailed(result.detail, tuple(result.output.splitlines()[-20:])),
                                    node=node))


def record_unhealthy(state_dir: Path, node: str) -> Path:
    """Append ``node`` to the state directory's unhealthy list (once), for the requeue's ``--exclude``."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / UNHEALTHY_NODES
    known = read_unhealthy(state_dir)
    if node not in known:
        with open(path, "a") as f:
            f.write(node + "\n")
            f.flush()
            os.fsync(f.fileno())
    return path


def read_unhealthy(state_dir: Path) -> list[str]:
    try:
        return [line.strip() for line in (state_dir / UNHEALTHY_NODES).read_text().splitlines() if line.strip()]
    except OSError:
        return []


def mark_repeat_offender(incident: Incident, earlier: list[Incident], node: str, nodes: int = 1) -> bool:
    """Name ``node`` a suspect when this failure is its REPEATS_MAKE_SUSPECT-th own failure in the run
    (a failure another node caused, ``peer_failure``, does not count): the same bad node comes back.
    Only in a job of several nodes (``nodes``): on one node every failure is that node's, so repeating
    says nothing of the node (a failing job fails there too), and there is no other node of the job to
    run it on instead."""
    if nodes < 2:
        return False
    own = [i for i in [*earlier, incident] if i.reason in ATTEMPT_FAILURES and i.reason != EndReason.PEER_FAILURE]
    if incident not in own or len(own) < REPEATS_MAKE_SUSPECT or node in incident.suspect_nodes:
        return False
    incident.suspect_nodes.append(node)
    note = f"node {node} failed {len(own)} attempts of this run"
    incident.verdict = f"{incident.verdict}; {note}" if incident.verdict else note
    return True
