"""How an attempt ended: the frozen :class:`AttemptResult`, made once by :func:`classify` from the evidence
gathered first (:mod:`supervisor.diagnosis.evidence`), and the rules it applies.

One place for the rules, so the run loop, the multi-node engine and the fast rank-death path
(:mod:`supervisor.diagnosis.rank_deaths`) describe an ending the same way: a launcher's exit code, torchrun's
"Root Cause" report (a SIGKILLed worker hides behind torchrun's own exit 1; ``accelerate launch`` with
several processes runs torchrun's agent in process and prints the same report), the error accelerate's
one-process launcher raises (its child's fate, behind its own exit 1), torchelastic's structured error
file (:data:`ERROR_FILE_ENV`), a signal, an OOM kill (a SIGKILL while the kernel's OOM-kill count rose),
and what a failed worker said of the GPU (:mod:`supervisor.diagnosis.gpu_failures`: CUDA OOM, NCCL, CUDA error, GPU lost).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from supervisor.diagnosis.evidence import (AttemptEvidence, EndedElsewhere, Ending, ExitSeen, FlightEvidence,
                                           GpuEvidence, HangSeen, HealthFailed, StopSeen)
from supervisor.diagnosis.gpu_failures import KMSG, Probe, find_gpu_failure, hang_gpu_failure, probe_node
from supervisor.diagnosis.rank_deaths import RankDeath
from supervisor.lifecycle import EXCLUDES_NODE, EndReason

if TYPE_CHECKING:
    from supervisor.diagnosis.unkillable import StuckProcess


@dataclass(frozen=True)
class AttemptResult:
    """How one attempt ended: made once, by :func:`classify`, from the evidence
    (:class:`~supervisor.diagnosis.evidence.AttemptEvidence`); nothing rewrites it afterwards."""

    attempt: int
    reason: EndReason
    exit_code: int | None = None
    signal: str | None = None
    rank: int | None = None
    pid: int | None = None
    detail: str = ""
    stacks: dict[str, str] = field(default_factory=dict)
    last_step: int | None = None
    output_tail: list[str] = field(default_factory=list)
    ended: float = field(default_factory=time.monotonic)
    verdict: str = ""  # the stacks grouped (supervisor.diagnosis.stack_groups), when stacks were taken
    fr_verdict: str = ""  # the Flight Recorder's verdict on a hang (supervisor.diagnosis.flight_recorder)
    suspect_ranks: list[int] = field(default_factory=list)
    suspect_nodes: list[str] = field(default_factory=list)


_TORCHRUN_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")
_TORCHRUN_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank")


_AGENT_FAILED = re.compile(r"failed \(exitcode:\s*(-?\d+)\)\s*local_rank:\s*(\d+)\s*\(pid:\s*(\d+)\)")


def torchrun_root_cause(lines: list[str]) -> tuple[int, int, int] | None:
    """(rank, exit code, pid) of the first failed worker, from torchrun's "Root Cause" report or,
    for launchers that print only the agent's line (NVRx ft_launcher), ``failed (exitcode: -9) local_rank: R``."""
    rank = None
    for line in lines[next((i for i, text in enumerate(lines) if "Root Cause" in text), len(lines)):]:
        if (m := _TORCHRUN_RANK.search(line)) is not None:
            rank = int(m.group(1))
        elif (m := _TORCHRUN_EXIT.search(line)) is not None and rank is not None:
            return rank, int(m.group(1)), int(m.group(2))
    for line in lines:
        if (m := _AGENT_FAILED.search(line)) is not None:
            return int(m.group(2)), int(m.group(1)), int(m.group(3))
    return None


# accelerate's one-process launcher (``simple_launcher``: ``accelerate launch`` without --multi_gpu, e.g.
# --cpu, and ``trl sft`` on one process) runs the script as its child and raises this on its failure:
# ``subprocess.CalledProcessError: Command '[...]' died with <Signals.SIGKILL: 9>.``
_CALLED_PROCESS = re.compile(r"CalledProcessError: Command '(?P<cmd>.*)' (?:died with <Signals\.(?P<sig>\w+): "
                             r"(?P<num>\d+)>|died with unknown signal (?P<unknown>\d+)|returned non-zero exit status "
                             r"(?P<code>\d+))\.\s*$")
_SIMPLE_LAUNCHER = "simple_launcher"


def accelerate_child_exit(lines: list[str]) -> tuple[int | None, int] | None:
    """(rank, exit code; negative: a signal) of the one process accelerate's one-process launcher ran,
    from the error it raised; None when the output holds none. Rank 0: it is the job's only process
    (accelerate's ``process_index`` 0), unless the launcher ran mpirun (a rank unknown)."""
    for i in range(len(lines) - 1, -1, -1):
        m = _CALLED_PROCESS.search(lines[i])
        if m is None:
            continue
        if not any(_SIMPLE_LAUNCHER in line for line in lines[max(0, i - 20):i]):
            return None  # another program's subprocess error, not accelerate's launcher's
        code = int(m["code"]) if m["code"] is not None else -int(m["num"] or m["unknown"])
        return (None if "mpirun" in m["cmd"] or "mpiexec" in m["cmd"] else 0), code
    return None


#: torchelastic's structured failure report: a launcher whose entry point is ``@record`` (torchrun) writes
#: the first failed worker's report where this names, when that worker wrote one (its own entry point is
#: ``@record`` and it raised): the worker's exception and exit code. Nothing is written for a worker that
#: was killed, nor by ``accelerate launch`` (it calls torchrun's agent without ``@record``); the output's
#: report names the rank then. rlsup sets it per attempt (:data:`ERROR_FILE_NAME` in the attempt's
#: directory) unless the user set it.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
ERROR_FILE_NAME = "torchelastic_error.json"


def error_file_for(hb_dir: Path) -> Path:
    """The attempt's structured error report (beside its ``heartbeats`` directory)."""
    return hb_dir.parent / ERROR_FILE_NAME


@dataclass(frozen=True)
class ElasticError:
    """What torchelastic's error file says: the worker's exception (its first line, and ``text``, all of
    it), and its exit code when the launcher added it (``errorCode``; negative: a signal)."""

    message: str
    exit_code: int | None = None
    text: str = ""


def read_error_file(path: str | os.PathLike | None) -> ElasticError | None:
    """The report at ``path``; None when there is none or it cannot be read (never raises)."""
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text(errors="replace"))
    except (OSError, ValueError):
        return None
    body = data.get("message") if isinstance(data, dict) else None
    if isinstance(body, str):  # the newer format: the message alone
        return ElasticError(body.strip().splitlines()[0] if body.strip() else "", text=body.strip())
    if not isinstance(body, dict):
        return None
    message = str(body.get("message") or "").strip()
    code = body.get("errorCode")
    return ElasticError(message.splitlines()[0] if message else "",
                        code if isinstance(code, int) and not isinstance(code, bool) else None, message)


def classify_exit(attempt: int, code: int, *, tail: list[str], last_step: int | None, job_pid: int,
                  first_dead: tuple[int, int] | None, oom_rose: bool,
                  stop_reason: EndReason | None, finished: str | None = None,
                  error_file: str | os.PathLike | None = None, since: float | None = None,
                  kernel_log: str | os.PathLike | None = KMSG, probe: Probe = probe_node) -> AttemptResult:
    """The job root exited with ``code`` (negative: a signal). ``stop_reason``: rlsup had asked it to
    stop (STOPPED or PREEMPTED); ``first_dead``: (rank, pid) of a rank seen gone before the exit;
    ``finished``: the line in which the trainer said its run is done (a progress preset's ``done``);
    ``error_file``: where the launcher may have written torchelastic's structured report, preferred to
    the output for the worker's exit code (the rank and pid, which it does not hold, come from the output)
    and for what it says of the GPU; ``since``: when the attempt started (``time.monotonic()``), for the
    kernel's GPU errors in ``kernel_log`` (:func:`supervisor.diagnosis.gpu_failures.find_gpu_failure`); ``probe``: NVML's
    word on this node's GPUs, asked only to confirm a lost GPU."""
    if code == 0 and stop_reason is None:
        return AttemptResult(attempt, EndReason.SUCCESS, 0, last_step=last_step, output_tail=tail)
    if finished is not None and stop_reason is None and code > 0:
        return AttemptResult(attempt, EndReason.SUCCESS, code, last_step=last_step, output_tail=tail,
                             detail=f"exit code {code} after the trainer said it finished: {finished[:200]!r}")
    if stop_reason is not None:
        return AttemptResult(attempt, stop_reason, code, last_step=last_step, output_tail=tail)
    rank, pid = first_dead if first_dead is not None else (None, None)
    worker_code: int | None = None
    root = torchrun_root_cause(tail)
    if root is not None:  # torchrun hides the worker's fate behind its own exit 1; its report has it
        rank, worker_code, pid = root
    elif (child := accelerate_child_exit(tail)) is not None:  # so does accelerate's one-process launcher
        rank, worker_code = child[0] if child[0] is not None else rank, child[1]
    report = read_error_file(error_file)
    if report is not None and report.exit_code is not None:
        worker_code = report.exit_code  # the structured report over the output's
    reason, sig = EndReason.EXIT_CODE, None
    if worker_code is not None and worker_code < 0:
        sig, reason = signame(-worker_code), EndReason.SIGNAL
    if code < 0:
        sig, reason, pid = signame(-code), EndReason.SIGNAL, pid or job_pid
    if sig == "SIGKILL" and oom_rose:
        reason = EndReason.OOM
    who = [f"rank {rank}"] if rank is not None else []
    who += [f"pid {pid}"] if pid is not None and rank is not None else []
    worker = f", the worker's exit code {worker_code}" if worker_code is not None and 0 < worker_code != code else ""
    detail = f"exit code {code}" + (f", {sig}" if sig else "") + worker + \
        (f" ({', '.join(who)})" if who else "") + (f": {report.message[:300]}" if report and report.message else "")
    result = AttemptResult(attempt, reason, code, signal=sig, rank=rank, pid=pid, detail=detail, last_step=last_step,
                           output_tail=tail)
    return with_gpu_failure(result, report.text if report else None, since=since, kernel_log=kernel_log,
                            probe=probe)


def with_gpu_failure(result: AttemptResult, message: str | None, *, since: float | None,
                     kernel_log: str | os.PathLike | None, probe: Probe = probe_node) -> AttemptResult:
    """``result`` (an ``exit_code`` or ``signal`` ending) with the GPU reason its texts give, the matched
    line appended to the detail. A SIGKILL came from outside (rlsup, the kernel's OOM killer, a person):
    what the ranks printed then is a consequence, so only the kernel's hardware report counts for it."""
    if result.reason not in (EndReason.EXIT_CODE, EndReason.SIGNAL):
        return result
    killed = result.signal == "SIGKILL"
    gpu = find_gpu_failure(None if killed else message, [] if killed else result.output_tail, since=since,
                           kernel_log=kernel_log, probe=probe)
    if gpu is None:
        return result
    return replace(result, reason=gpu.reason, detail=_joined(result.detail, gpu.describe()))


def from_rank_death(attempt: int, death: RankDeath, *, tail: list[str], last_step: int | None,
                    oom_rose: bool, since: float | None = None,
                    kernel_log: str | os.PathLike | None = KMSG, probe: Probe = probe_node) -> AttemptResult:
    """A rank died while its launcher still ran: the attempt ends now, classified by the rank's status and
    what the output (and the kernel, from ``since``) says of the GPU; the launcher has written no error
    file yet."""
    reason = EndReason.SIGNAL if death.signal else EndReason.EXIT_CODE
    if death.signal == "SIGKILL" and oom_rose:
        reason = EndReason.OOM
    result = AttemptResult(attempt, reason, death.exit_code, signal=death.signal, rank=death.rank, pid=death.pid,
                           detail=f"{death.describe()}; attempt ended without waiting for the launcher",
                           last_step=last_step, output_tail=tail)
    return with_gpu_failure(result, None, since=since, kernel_log=kernel_log, probe=probe)


def with_hang_gpu_failure(result: AttemptResult, *, since: float | None,
                          kernel_log: str | os.PathLike | None = KMSG, probe: Probe = probe_node) -> AttemptResult:
    """A hang or startup timeout with a GPU of this job's lost (a hardware Xid in the kernel log since
    ``since``, :func:`supervisor.diagnosis.gpu_failures.hang_gpu_failure`) is ``gpu_lost``, the hang's detail kept:
    a GPU fallen off the bus shows as a hung collective. The output is not read (a hang prints nothing
    trustworthy); a fault not tied to the job is only noted."""
    if result.reason not in (EndReason.HANG, EndReason.STARTUP_TIMEOUT):
        return result
    lost, unproven = hang_gpu_failure(since, kernel_log, probe)
    if lost is not None:
        return replace(result, reason=EndReason.GPU_LOST, detail=_joined(result.detail, lost.describe()))
    return replace(result, detail=_joined(result.detail, unproven)) if unproven else result


def _joined(detail: str, more: str) -> str:
    return f"{detail}; {more}" if detail else more


# ------------------------------------------------------------------------------------------ the one classifier

SETTLED = (EndReason.SUCCESS, EndReason.STOPPED, EndReason.PREEMPTED)  # the job's own ending: what is left gets grace


def job_settled(ending: Ending) -> bool:
    """Whether the job ended on its own terms (success, or the stop rlsup asked for), as :func:`classify`
    will say: what it left is then ended with SIGTERM and grace, and no stuck process overrides it."""
    if isinstance(ending, StopSeen):
        return True
    if isinstance(ending, ExitSeen):
        return ending.stop_reason is not None or ending.code == 0 or (ending.finished is not None and ending.code > 0)
    return False


def classify(ev: AttemptEvidence) -> AttemptResult:
    """How the attempt ended, from all its evidence, once: its ending (an exit, a rank's death, a hang,
    a stop...) with the GPU's word on it, then the processes stuck after the kill
    (:func:`supervisor.diagnosis.unkillable.unkillable_outcome`), the Flight Recorder's verdict across nodes,
    and, where the node is excluded (:data:`EXCLUDES_NODE`), the node as the suspect."""
    result = _ending(ev)
    if ev.stuck:
        result = unkillable_outcome(result, ev.stuck, ev.kill_grace)
    result = _with_shared_flight(result, ev.shared_flight)
    if result.reason in EXCLUDES_NODE:
        result = replace(result, verdict=result.verdict or f"node {ev.node} is unhealthy: {result.detail}",
                         suspect_nodes=[*result.suspect_nodes, ev.node])
    return replace(result, ended=ev.ended)


def _ending(ev: AttemptEvidence) -> AttemptResult:
    end, gpu, tail, step = ev.ending, ev.gpu or GpuEvidence(None, None), list(ev.output_tail), ev.last_step
    if isinstance(end, ExitSeen):
        return classify_exit(ev.attempt, end.code, tail=tail, last_step=step, job_pid=end.job_pid,
                             first_dead=end.first_dead, oom_rose=ev.oom_rose, stop_reason=end.stop_reason,
                             finished=end.finished, error_file=end.error_file, since=gpu.since,
                             kernel_log=gpu.kernel_log, probe=gpu.probe)
    if isinstance(end, RankDeath):
        return from_rank_death(ev.attempt, end, tail=tail, last_step=step, oom_rose=ev.oom_rose, since=gpu.since,
                               kernel_log=gpu.kernel_log, probe=gpu.probe)
    if isinstance(end, HangSeen):
        return with_hang_gpu_failure(_hang(ev, end), since=gpu.since, kernel_log=gpu.kernel_log, probe=gpu.probe)
    if isinstance(end, StopSeen):
        return _stop(ev, end)
    if isinstance(end, EndedElsewhere):
        return AttemptResult(ev.attempt, end.reason, None, detail=end.detail, last_step=step, output_tail=tail)
    if isinstance(end, HealthFailed):
        return AttemptResult(ev.attempt, EndReason.UNHEALTHY, None, detail=end.detail, output_tail=list(end.output_tail),
                             verdict=f"node {ev.node} is unhealthy: {end.detail}", suspect_nodes=[ev.node])
    said = end.describe()  # a straggler (straggler_action: restart)
    return AttemptResult(ev.attempt, EndReason.STRAGGLER, None, rank=end.rank, pid=end.pid, detail=said, verdict=said,
                         suspect_ranks=[end.rank], suspect_nodes=[end.node], last_step=step, output_tail=tail)


def _hang(ev: AttemptEvidence, hang: HangSeen) -> AttemptResult:
    """A hang: its stacks' verdict (for a hang seen in the job's output, the stuck trainer they name, never the
    launcher), this node's Flight Recorder verdict, whose suspects come before the stacks' (it saw the
    collectives themselves)."""
    from supervisor.diagnosis.stack_groups import read_stacks
    from supervisor.diagnosis.step_reports import JOB_RANK

    found = read_stacks(hang.stacks, ev.node, output_hang=hang.rank == JOB_RANK)
    rank, pid = (found.rank, found.pid) if found.named else (hang.rank, hang.pid)
    ranks, nodes = found.suspect_ranks, found.suspect_nodes
    fr = ev.flight
    if fr is not None and fr.suspects:
        ranks, nodes = list(fr.suspects), sorted({*nodes, ev.node})
    return AttemptResult(ev.attempt, hang.reason, None, rank=rank, pid=pid,
                         detail=_joined(hang.detail, found.stuck) if found.stuck else hang.detail, stacks=hang.stacks,
                         last_step=ev.last_step, output_tail=list(ev.output_tail), verdict=found.verdict,
                         fr_verdict=fr.text if fr is not None else "", suspect_ranks=ranks, suspect_nodes=nodes)


def _stop(ev: AttemptEvidence, stop: StopSeen) -> AttemptResult:
    """A stop rlsup asked for; where the job had to be killed, its stacks' verdict."""
    from supervisor.diagnosis.stack_groups import read_stacks

    found = read_stacks(stop.stacks, ev.node) if stop.stacks else None
    return AttemptResult(ev.attempt, stop.reason, stop.code, last_step=ev.last_step, output_tail=list(ev.output_tail),
                         stacks=stop.stacks, detail=f"job exited with {stop.code}" if stop.code is not None else
                         "killed after stop_grace", verdict=found.verdict if found else "",
                         suspect_ranks=found.suspect_ranks if found else [],
                         suspect_nodes=found.suspect_nodes if found else [])


def unkillable_outcome(result: AttemptResult, stuck: Sequence[StuckProcess], grace: float) -> AttemptResult:
    """An attempt whose processes outlived SIGKILL in state D ends ``unkillable`` (the node is excluded: exit
    77), its original ending kept in the detail, the stuck processes named. A job that succeeded, or was
    stopped or preempted, keeps its ending (a finished job is not requeued elsewhere; a stop stays a stop)."""
    from supervisor.diagnosis.unkillable import uninterruptible, verdict

    held = uninterruptible(list(stuck))
    if not held or result.reason in SETTLED:
        return result
    before = f"{result.reason}: {result.detail}" if result.detail else str(result.reason)
    ranks = sorted({*result.suspect_ranks, *(p.rank for p in held if p.rank is not None)})
    rank, pid = (held[0].rank, held[0].pid) if result.rank is None else (result.rank, result.pid)
    return replace(result, reason=EndReason.UNKILLABLE, detail=f"{verdict(list(stuck), grace)} (the attempt had "
                   f"ended: {before})", suspect_ranks=ranks, rank=rank, pid=pid)


def _with_shared_flight(result: AttemptResult, shared: FlightEvidence | None) -> AttemptResult:
    """The Flight Recorder's verdict across nodes over this node's own, its suspects over the stacks' (as on one
    node); where none came, this node's own verdict says why."""
    if shared is None:
        return result
    if not shared.text:
        return replace(result, fr_verdict=f"{result.fr_verdict or 'flight recorder'} (no verdict across nodes: "
                                          f"{shared.missing})") if shared.missing else result
    if not shared.suspects:
        return replace(result, fr_verdict=shared.text)
    return replace(result, fr_verdict=shared.text, suspect_ranks=list(shared.suspects),
                   suspect_nodes=sorted({*result.suspect_nodes, *shared.suspect_nodes}))


def signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"
