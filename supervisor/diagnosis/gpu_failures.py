"""GPU-era failures told apart by their text: CUDA out of memory, NCCL errors and timeouts, CUDA errors,
and a GPU lost to hardware (ECC, fallen off the bus, a device gone), from the worker's exception (torchelastic's
error file), the job's output, and the kernel's ``NVRM: Xid`` lines where the kernel log can be read.

Without this every one of them is ``exit_code`` (or ``signal``, for NCCL's abort), and a node whose GPU broke
is restarted on until ``max_restarts`` is spent. The rules are ONE table (:data:`RULES`), read where the
failure is: the error file alone when it holds the worker's exception, else the output after its LAST
``Traceback`` (when there is one), newest line first, so a CUDA OOM a trainer caught and logged before
another crash is not taken for it; within a line the table's order decides (an illegal memory access the
NCCL watchdog reports is a CUDA error). The matched line is kept as the incident's detail.

``gpu_lost`` excludes the node (:data:`supervisor.lifecycle.EXCLUDES_NODE`), so text alone never makes it: a
logged, retried ``CUDA error: unknown error`` is no proof. It needs the node check through NVML
(:func:`supervisor.diagnosis.gpu_health.check_gpus`) failing, or a hardware Xid in the kernel log since the attempt
started on a GPU of this job's (its PCI bus id among the job's, :func:`supervisor.diagnosis.gpu_health.job_bus_ids`:
on a shared node another job's Xid is not ours); without either it is ``cuda_error``, the detail saying why.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable

from supervisor.lifecycle import EndReason

KMSG = "/dev/kmsg"  # the kernel's log, one record per read; readable by root (or with dmesg_restrict=0)
LINE_MAX = 300  # characters of the matched line kept in the detail
KERNEL_LOG_MAX = 4 << 20  # bytes read from a kernel log at most (the ring buffer is far smaller)
KMSG_MARGIN_S = 5.0  # kernel stamps this much before the attempt's start still count (kmsg vs monotonic drift)
TRACEBACK = "Traceback (most recent call last)"


@dataclass(frozen=True)
class Rule:
    """One row of the table: text that means ``reason``, and what to call it in the detail."""

    reason: EndReason
    what: str
    pattern: re.Pattern[str]


def _rule(reason: EndReason, what: str, pattern: str) -> Rule:
    return Rule(reason, what, re.compile(pattern))


#: The table, in priority order (case-sensitive: the texts are the libraries' own).
RULES: tuple[Rule, ...] = (
    # The GPU itself is gone or broken: another attempt on this node fails the same way.
    _rule(EndReason.GPU_LOST, "uncorrectable ECC error",
          r"uncorrectable ECC error encountered|cudaErrorECCUncorrectable|CUDA_ERROR_ECC_UNCORRECTABLE"),
    _rule(EndReason.GPU_LOST, "GPU has fallen off the bus", r"fallen off the bus"),
    _rule(EndReason.GPU_LOST, "CUDA unknown error (device lost)",
          r"CUDA error: unknown error|cudaErrorUnknown\b|CUDA_ERROR_UNKNOWN\b"),
    # The job asked for more than the GPU has.
    _rule(EndReason.CUDA_OOM, "CUDA out of memory",
          r"\bOutOfMemoryError\b.*CUDA|CUDA out of memory|CUDA error: out of memory|cudaErrorMemoryAllocation"),
    # Exclusive-process GPUs still held by the previous attempt's dying rank say this: not the node's fault.
    _rule(EndReason.CUDA_ERROR, "CUDA devices busy or unavailable",
          r"cudaErrorDevicesUnavailable|CUDA_ERROR_DEVICES_UNAVAILABLE|CUDA-capable device\(s\) is/are busy or unavailable"),
    # Any other CUDA error (illegal memory access, device-side assert, launch failure): the job's, usually.
    _rule(EndReason.CUDA_ERROR, "CUDA error",
          r"CUDA error: |\bcudaError[A-Z]\w+|\bCUDA_ERROR_[A-Z_]+|cuda runtime error \(\d+\)"),
    # NCCL: a collective timed out (the watchdog), or NCCL failed.
    _rule(EndReason.NCCL_ERROR, "NCCL collective timeout", r"Watchdog caught collective operation timeout"),
    _rule(EndReason.NCCL_ERROR, "NCCL error",
          r"NCCL error|\bnccl(?:InternalError|SystemError|UnhandledCudaError|RemoteError|InvalidUsage|InvalidArgument)\b"
          r"|NCCL communicator was aborted|NCCL Error \d"),
)

# Details an NCCL line may carry: the collective (``OpType=ALLREDUCE``), its sequence number and timeout.
_OP = re.compile(r"OpType=(\w+)")
_SEQ = re.compile(r"SeqNum=(\d+)")
_TIMEOUT = re.compile(r"Timeout\(ms\)=(\d+)")

#: Xid codes the NVIDIA driver logs for a hardware fault that another attempt on this node would meet again
#: (NVIDIA's Xid catalog, docs.nvidia.com/deploy/xid-errors): 48 double-bit ECC, 62 internal micro-controller
#: halt, 64 ECC page retirement / row remapping failure, 74 NVLink error, 79 fallen off the bus, 95 uncontained
#: ECC error, 119/120 GSP timeout/error, 140 unrecovered ECC error. Others (13 graphics exception, 31 MMU fault,
#: 43 stopped by the application, 45 preemptive cleanup, 94 contained ECC error) follow from, or end, only the
#: job that caused them and are not read as the node's fault.
HARDWARE_XIDS = frozenset({48, 62, 64, 74, 79, 95, 119, 120, 140})
_XID = re.compile(r"NVRM: Xid \((?P<pci>[^)]*)\): (?P<code>\d+)")
_KMSG_STAMP = re.compile(r"^\d+,\d+,(?P<usec>\d+),[^;]*;")  # /dev/kmsg: "prio,seq,usec,flags;text"
_DMESG_STAMP = re.compile(r"^\[\s*(?P<sec>\d+\.\d+)\]\s*")  # dmesg: "[ 1843.308145] text"


@dataclass(frozen=True)
class GpuFailure:
    """What the text says ended the attempt: the reason, what the rule calls it, the line, and where it was."""

    reason: EndReason
    what: str
    line: str
    source: str  # "error file", "output" or "kernel log"
    note: str = ""  # why a text's gpu_lost was not taken as one
    pci: tuple[int, int, int] | None = None  # a kernel line's GPU: (domain, bus, device)

    def describe(self) -> str:
        return f"{self.what} ({self.source}): {self.line}" + (f"; {self.note}" if self.note else "")


@dataclass(frozen=True)
class GpuProbe:
    """What NVML says of this node when an attempt ended: the PCI addresses of the job's GPUs (None: cannot
    be known), and the node check's failure when NVML answered and found one (None: healthy, or no NVML)."""

    bus_ids: frozenset[tuple[int, int, int]] | None
    broken: str | None
    why: str  # the check's line, or why the GPUs cannot be known


_PCI = re.compile(r"(?:PCI:)?(?P<dom>[0-9a-fA-F]{4,8}):(?P<bus>[0-9a-fA-F]{2}):(?P<dev>[0-9a-fA-F]{2})(?:\.\d)?")


def pci_address(text: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of the first PCI address in ``text``: the kernel's ``PCI:0000:3b:00`` and
    NVML's ``00000000:3B:00.0`` alike."""
    m = _PCI.search(text)
    return (int(m["dom"], 16), int(m["bus"], 16), int(m["dev"], 16)) if m else None


def probe_node() -> GpuProbe:
    """This node's answer through NVML (:mod:`supervisor.diagnosis.gpu_health`): the job's GPUs and the builtin check."""
    from supervisor.diagnosis.gpu_health import check_gpus, job_bus_ids

    ids, why = job_bus_ids()
    health = check_gpus()
    answered = health.gpus is not None  # NVML counted the GPUs: its verdict is one (a CPU node's is not)
    broken = health.detail if answered and not health.ok else None
    found = None if ids is None else frozenset(a for a in map(pci_address, ids) if a is not None)
    return GpuProbe(found, broken, health.detail if ids is not None else f"{why}; node check: {health.detail}")


Probe = Callable[[], GpuProbe]


def _what(rule: Rule, line: str) -> str:
    """The rule's name, with the collective an NCCL line names (OpType, SeqNum, timeout)."""
    if rule.reason != EndReason.NCCL_ERROR or (op := _OP.search(line)) is None:
        return rule.what
    extra = [f"SeqNum={m.group(1)}" for m in [_SEQ.search(line)] if m] + \
        [f"timeout {m.group(1)} ms" for m in [_TIMEOUT.search(line)] if m]
    return f"{rule.what} in {op.group(1)}" + (f" ({', '.join(extra)})" if extra else "")


def classify_text(lines: Iterable[str], source: str = "output") -> GpuFailure | None:
    """What ``lines`` say ended the job: read from the last ``Traceback`` line on (all of them without one),
    the newest line any rule of :data:`RULES` matches, named by the first rule (the table's order) that
    matches it; None when none does."""
    text = [line for line in lines if line and line.strip()]
    last = max((i for i, line in enumerate(text) if TRACEBACK in line), default=0)
    for line in reversed(text[last:]):
        for rule in RULES:
            if rule.pattern.search(line):
                return GpuFailure(rule.reason, _what(rule, line), line.strip()[:LINE_MAX], source)
    return None


def _read_nonblocking(path: str | os.PathLike) -> list[str]:
    """The text of ``path`` without ever waiting: /dev/kmsg gives one record per read and EAGAIN at its end
    (a plain read would block for the next message), a plain file reads to its end. [] when unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return []
    records: list[str] = []
    size = 0
    try:
        while size < KERNEL_LOG_MAX:
            try:
                chunk = os.read(fd, 65536)
            except OSError as e:
                if e.errno == errno.EPIPE:  # /dev/kmsg: records overwritten while read; the next read goes on
                    continue
                break  # EAGAIN: the end of /dev/kmsg; EPERM/EINVAL: nothing (more) readable
            if not chunk:
                break
            size += len(chunk)
            records.append(chunk.decode(errors="replace"))
    finally:
        os.close(fd)
    return "".join(records).splitlines()


def _stamp(line: str) -> tuple[float | None, str]:
    """(seconds since boot, the text) of a kernel log line; None when the line has no stamp."""
    if (m := _KMSG_STAMP.match(line)) is not None:
        return int(m["usec"]) / 1e6, line[m.end():]
    if (m := _DMESG_STAMP.match(line)) is not None:
        return float(m["sec"]), line[m.end():]
    return None, line


def kernel_gpu_failures(since: float | None, path: str | os.PathLike = KMSG) -> list[GpuFailure]:
    """Hardware faults the GPU driver logged in the kernel log at ``path`` (``/dev/kmsg`` or a file of
    ``dmesg`` or ``/dev/kmsg`` lines) at or after ``since`` less :data:`KMSG_MARGIN_S` (seconds since boot,
    the clock of ``time.monotonic()`` on Linux, which the kernel's stamps share; a line without a stamp is
    the previous line's, and counts when no line had one): each :data:`HARDWARE_XIDS` Xid, and the driver's
    "fallen off the bus" without one, with the GPU's PCI address (a message's first). [] when the log cannot
    be read (no root, a container) or says nothing of the kind."""
    if not Path(path).exists():
        return []
    found: list[GpuFailure] = []
    when: float | None = None
    pci: tuple[int, int, int] | None = None
    for line in _read_nonblocking(path):
        stamp, text = _stamp(line)
        if stamp is not None:  # a new message; a continuation line is its message's
            when, pci = stamp, None
        if since is not None and when is not None and when < since - KMSG_MARGIN_S:
            continue
        pci = pci or pci_address(text)
        if (m := _XID.search(text)) is not None and int(m["code"]) in HARDWARE_XIDS:
            found.append(GpuFailure(EndReason.GPU_LOST, f"Xid {m['code']}", text.strip()[:LINE_MAX], "kernel log",
                                    pci=pci_address(m["pci"])))
        elif "NVRM" in text and "fallen off the bus" in text:
            found.append(GpuFailure(EndReason.GPU_LOST, "GPU has fallen off the bus", text.strip()[:LINE_MAX],
                                    "kernel log", pci=pci))
    return found


def kernel_gpu_failure(since: float | None, path: str | os.PathLike = KMSG) -> GpuFailure | None:
    """The first of :func:`kernel_gpu_failures`, whichever GPU it names."""
    return next(iter(kernel_gpu_failures(since, path)), None)


def ours(faults: list[GpuFailure], probe: GpuProbe) -> tuple[GpuFailure | None, str]:
    """The kernel fault that proves this job's GPU lost, and otherwise what the faults say (for a detail).
    A fault on one of the job's GPUs proves it; where the job's GPUs cannot be known, only with the node
    check failing too; one on another GPU (another job's, on a shared node) is not this job's."""
    if not faults:
        return None, ""
    if probe.bus_ids is not None:
        mine = [f for f in faults if f.pci in probe.bus_ids]
        if mine:
            return mine[0], ""
        if all(f.pci is not None for f in faults):
            return None, ""  # another job's GPU
    unknown = next(f for f in faults if probe.bus_ids is None or f.pci is None)
    if probe.broken is not None:
        return replace(unknown, note=f"node check: {probe.broken}"), ""
    return None, f"{unknown.what} (kernel log) on a GPU not known to be this job's ({probe.why}): " \
        f"{unknown.line}; not excluding the node on it"


def _confirmed(text: GpuFailure, kernel: list[GpuFailure], probe: GpuProbe) -> GpuFailure:
    """A text's gpu_lost, kept where NVML's node check fails or the kernel logged a hardware fault this
    attempt (on a GPU of the job's, or one it cannot tell: two witnesses), else ``cuda_error`` saying why."""
    if probe.broken is not None:
        return replace(text, note=f"confirmed by the node check: {probe.broken}")
    if kernel and (probe.bus_ids is None or any(f.pci in probe.bus_ids or f.pci is None for f in kernel)):
        return replace(text, note=f"confirmed by the kernel log: {kernel[0].line}")
    return replace(text, reason=EndReason.CUDA_ERROR,
                   note=f"gpu_lost not confirmed (node check: {probe.why}; no hardware Xid in the kernel log): "
                        "restarted, the node kept")


def find_gpu_failure(message: str | None, tail: list[str], *, since: float | None = None,
                     kernel_log: str | os.PathLike | None = KMSG, probe: Probe = probe_node) -> GpuFailure | None:
    """What ended the attempt, GPU-wise: the kernel's word on a hardware fault of this job's GPU first
    (whatever the ranks printed about it), then the worker's exception from torchelastic's error file
    (``message``) alone when there is one, else the output. A text's ``gpu_lost`` stands only when
    confirmed (:func:`_confirmed`). The kernel log is read only with ``since`` (the attempt's start: an older
    Xid is another attempt's, or another boot's) and a ``kernel_log``; ``probe`` (NVML) is asked only when
    a text or the kernel names a lost GPU."""
    kernel = kernel_gpu_failures(since, kernel_log) if since is not None and kernel_log is not None else []
    node = probe() if kernel else None
    hw, unproven = ours(kernel, node) if node is not None else (None, "")
    if hw is not None:
        return hw
    found = classify_text(message.splitlines(), "error file") if message and message.strip() else classify_text(tail)
    if found is not None and found.reason == EndReason.GPU_LOST:
        found = _confirmed(found, kernel, node or probe())
    if unproven and (found is None or found.reason != EndReason.GPU_LOST):
        return replace(found, note="; ".join(filter(None, [found.note, unproven]))) if found is not None else \
            GpuFailure(EndReason.CUDA_ERROR, "GPU fault in the kernel log, unconfirmed", unproven, "kernel log")
    return found


def hang_gpu_failure(since: float | None, kernel_log: str | os.PathLike | None = KMSG,
                     probe: Probe = probe_node) -> tuple[GpuFailure | None, str]:
    """For a hang (a GPU fallen off the bus leaves a collective hung): the kernel log's proof of this job's
    GPU lost, and otherwise a note on a fault it could not tie to the job; the output is not read."""
    if since is None or kernel_log is None or not (kernel := kernel_gpu_failures(since, kernel_log)):
        return None, ""
    return ours(kernel, probe())
