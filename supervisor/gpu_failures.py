"""GPU-era failures told apart by their text: CUDA out of memory, NCCL errors and timeouts, CUDA errors,
and a GPU lost to hardware (ECC, fallen off the bus, a device gone), from the worker's exception (torchelastic's
error file), the job's output, and the kernel's ``NVRM: Xid`` lines where the kernel log can be read.

Without this every one of them is ``exit_code`` (or ``signal``, for NCCL's abort), and a node whose GPU broke
is restarted on until ``max_restarts`` is spent. The rules are ONE ordered table (:data:`RULES`): the first rule
that matches any line wins, so a root cause comes before what it causes elsewhere (a rank's OOM or illegal
memory access leaves its peers in an NCCL timeout; all of them print into one output). The matched line is
kept as the incident's detail. :data:`supervisor.lifecycle.EXCLUDES_NODE` says what each reason does.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from supervisor.lifecycle import EndReason

KMSG = "/dev/kmsg"  # the kernel's log, one record per read; readable by root (or with dmesg_restrict=0)
LINE_MAX = 300  # characters of the matched line kept in the detail
KERNEL_LOG_MAX = 4 << 20  # bytes read from a kernel log at most (the ring buffer is far smaller)


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
    _rule(EndReason.GPU_LOST, "CUDA devices unavailable",
          r"cudaErrorDevicesUnavailable|CUDA_ERROR_DEVICES_UNAVAILABLE|CUDA-capable device\(s\) is/are busy or unavailable"),
    _rule(EndReason.GPU_LOST, "CUDA unknown error (device lost)",
          r"CUDA error: unknown error|cudaErrorUnknown\b|CUDA_ERROR_UNKNOWN\b"),
    # The job asked for more than the GPU has.
    _rule(EndReason.CUDA_OOM, "CUDA out of memory",
          r"\bOutOfMemoryError\b.*CUDA|CUDA out of memory|CUDA error: out of memory|cudaErrorMemoryAllocation"),
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

    def describe(self) -> str:
        return f"{self.what} ({self.source}): {self.line}"


def _what(rule: Rule, line: str) -> str:
    """The rule's name, with the collective an NCCL line names (OpType, SeqNum, timeout)."""
    if rule.reason != EndReason.NCCL_ERROR or (op := _OP.search(line)) is None:
        return rule.what
    extra = [f"SeqNum={m.group(1)}" for m in [_SEQ.search(line)] if m] + \
        [f"timeout {m.group(1)} ms" for m in [_TIMEOUT.search(line)] if m]
    return f"{rule.what} in {op.group(1)}" + (f" ({', '.join(extra)})" if extra else "")


def classify_text(lines: Iterable[str], source: str = "output") -> GpuFailure | None:
    """The first rule of :data:`RULES` that matches any of ``lines`` (the table's order, not the lines',
    decides), with the first line it matched; None when no rule does."""
    text = [line for line in lines if line and line.strip()]
    for rule in RULES:
        for line in text:
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


def kernel_gpu_failure(since: float | None, path: str | os.PathLike = KMSG) -> GpuFailure | None:
    """A hardware fault the GPU driver logged in the kernel log at ``path`` (``/dev/kmsg`` or a file of
    ``dmesg`` or ``/dev/kmsg`` lines) at or after ``since`` (seconds since boot, the clock of
    ``time.monotonic()`` on Linux, which the kernel's stamps share; a line without a stamp is the previous
    line's, and counts when no line had one): a
    :data:`HARDWARE_XIDS` Xid, or the driver's "fallen off the bus" without one. None when the log cannot
    be read (no root, a container) or says nothing of the kind."""
    if not Path(path).exists():
        return None
    when: float | None = None
    for line in _read_nonblocking(path):
        stamp, text = _stamp(line)
        when = stamp if stamp is not None else when  # a continuation line is its message's
        if since is not None and when is not None and when < since:
            continue
        if (m := _XID.search(text)) is not None and int(m["code"]) in HARDWARE_XIDS:
            return GpuFailure(EndReason.GPU_LOST, f"Xid {m['code']}", text.strip()[:LINE_MAX], "kernel log")
        if "NVRM" in text and "fallen off the bus" in text:
            return GpuFailure(EndReason.GPU_LOST, "GPU has fallen off the bus", text.strip()[:LINE_MAX], "kernel log")
    return None


def find_gpu_failure(message: str | None, tail: list[str], *, since: float | None = None,
                     kernel_log: str | os.PathLike | None = KMSG) -> GpuFailure | None:
    """What ended the attempt, GPU-wise: the kernel's word on a hardware fault first (whatever the ranks
    printed about it), then the worker's exception from torchelastic's error file (``message``), then the
    output. The kernel log is read only with ``since`` (the attempt's start: an older Xid is another
    attempt's, or another boot's) and a ``kernel_log``."""
    if since is not None and kernel_log is not None and (hw := kernel_gpu_failure(since, kernel_log)) is not None:
        return hw
    if message and (found := classify_text(message.splitlines(), "error file")) is not None:
        return found
    return classify_text(tail)
