"""supervisor.diagnosis.gpu_failures and its use in supervisor.diagnosis.outcome: GPU-era failures (CUDA OOM, NCCL error or
timeout, CUDA error, a GPU lost) told apart by the texts real jobs print (tests/data/gpu_errors/, each file's
source in its README: recorded on an H200, or from public issue threads), the structured error file instead of
the output, the output after its last traceback, newest line first, a text's lost GPU confirmed by NVML's node
check or the kernel, the kernel's Xid lines read from a log file and tied to the job's GPUs by PCI address, a
hang with this job's GPU lost, and the run loop's answer to a lost GPU (exit 77). NVML's answers come through
an injected probe (:class:`GpuProbe`): this machine has no GPU to lose."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from support.fake_run_loop import Attempt, incidents, make
from supervisor import exit_codes
from supervisor.diagnosis.outcome import (AttemptResult, classify_exit, from_rank_death, read_error_file,
                                    with_hang_gpu_failure)
from supervisor.diagnosis.gpu_failures import (RULES, GpuProbe, classify_text, find_gpu_failure, kernel_gpu_failure,
                                     pci_address, probe_node)
from supervisor.diagnosis.gpu_health import NvmlError, job_bus_ids
from supervisor.run.node_health import read_unhealthy
from supervisor.lifecycle import ATTEMPT_FAILURES, EXCLUDES_NODE, EndReason
from supervisor.cli.metrics import REASONS
from supervisor.diagnosis.rank_deaths import RankDeath

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu_errors"
R = EndReason
XID79 = DATA / "kmsg_xid79.txt"  # Xid 79 on PCI 0000:44:00, stamped 1843.308 s after boot


def probe(bus: set[tuple[int, int, int]] | None, broken: str | None = None, why: str = "NVML: 8 GPU(s) healthy"):
    """NVML's answer as :func:`probe_node` gives it: the job's GPUs (None: unknown) and the check's failure."""
    return lambda: GpuProbe(None if bus is None else frozenset(bus), broken, why)


OURS = probe({(0, 0x44, 0)})  # the job's GPU is the one the Xid names, the node check passes
OTHERS = probe({(0, 0x3b, 0), (0, 0x3c, 0)})  # a shared node: this job's GPUs are others
NO_NVML = probe(None, None, "NVML unavailable (NvmlError: LIBRARY_NOT_FOUND)")  # nothing can be confirmed
BROKEN = probe({(0, 0x44, 0)}, "GPU 0: not usable (GPU_IS_LOST: GPU is lost)")


def lines(name: str) -> list[str]:
    return (DATA / name).read_text().splitlines()


@pytest.mark.parametrize("name, reason, what", [
    ("h200_cuda_oom.out", R.CUDA_OOM, "CUDA out of memory"),
    ("h200_torchrun_cuda_oom.out", R.CUDA_OOM, "CUDA out of memory"),
    ("h200_cuda_device_assert.out", R.CUDA_ERROR, "CUDA error"),
    ("h200_torchrun_nccl_duplicate_gpu.out", R.NCCL_ERROR, "NCCL error"),
    ("nccl_watchdog_timeout.out", R.NCCL_ERROR,
     "NCCL collective timeout in ALLREDUCE (SeqNum=1580, timeout 600000 ms)"),
    ("nccl_watchdog_timeout_old.out", R.NCCL_ERROR,
     "NCCL collective timeout in ALLREDUCE (SeqNum=469508, timeout 1800000 ms)"),
    ("nccl_reduce_scatter_timeout.out", R.NCCL_ERROR, "NCCL collective timeout in _REDUCE_SCATTER_BASE"),
    ("nccl_unhandled_system_error.out", R.NCCL_ERROR, "NCCL error"),
    ("nccl_unhandled_cuda_error.out", R.NCCL_ERROR, "NCCL error"),
    ("cuda_ecc_uncorrectable.out", R.GPU_LOST, "uncorrectable ECC error"),
    ("cuda_ecc_uncorrectable_new.out", R.GPU_LOST, "uncorrectable ECC error"),
    ("cuda_unknown_error.out", R.GPU_LOST, "CUDA unknown error (device lost)"),
    ("cuda_illegal_memory_access_in_watchdog.out", R.CUDA_ERROR, "CUDA error"),
])
def test_recorded_texts_classify(name: str, reason: EndReason, what: str) -> None:
    found = classify_text(lines(name))
    assert found is not None and (found.reason, found.source) == (reason, "output"), found
    assert found.what.startswith(what), found
    assert found.line in {line.strip()[:300] for line in lines(name)}  # the line itself is the detail


@pytest.mark.parametrize("text, reason", [
    ("RuntimeError: CUDA error: an illegal memory access was encountered", R.CUDA_ERROR),
    ("RuntimeError: CUDA error: out of memory", R.CUDA_OOM),
    ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.70 GiB.", R.CUDA_OOM),
    ("RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable", R.CUDA_ERROR),
    ("RuntimeError: CUDA error: GPU has fallen off the bus", R.GPU_LOST),
    ("[rank3]: torch.distributed.DistBackendError: NCCL communicator was aborted on rank 3.", R.NCCL_ERROR),
    ("ncclInternalError: Internal check failed.", R.NCCL_ERROR),
    ("Traceback (most recent call last):\nValueError: bad batch", None),
    ("step 3 loss 0.25 (no CUDA here; nccl tuning notes)", None),
])
def test_texts_from_the_libraries(text: str, reason: EndReason | None) -> None:
    found = classify_text(text.splitlines())
    assert (found.reason if found else None) == reason, found


def test_the_newest_line_after_the_last_traceback_decides() -> None:
    """A rank's OOM printed after its peers' NCCL timeout is the OOM; an ECC error after an OOM the ECC error;
    a CUDA OOM a trainer caught and logged before another crash (its traceback) is not what ended the job,
    nor before a later NCCL error; within one line the table decides (the watchdog's illegal memory access)."""
    mixed = lines("nccl_watchdog_timeout.out") + lines("h200_cuda_oom.out")
    assert classify_text(mixed).reason == R.CUDA_OOM
    assert classify_text(lines("h200_cuda_oom.out") + lines("cuda_ecc_uncorrectable.out")).reason == R.GPU_LOST
    handled = ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (caught: halving the batch)"]
    assert classify_text(handled + ["step 9 loss 0.3", "Traceback (most recent call last):",
                                    '  File "train.py", line 3, in <module>', "ValueError: bad batch"]) is None
    device_assert = classify_text(handled + lines("h200_cuda_device_assert.out"))
    assert device_assert.reason == R.CUDA_ERROR, device_assert
    assert classify_text(handled + lines("nccl_watchdog_timeout.out")).reason == R.NCCL_ERROR
    assert classify_text(lines("cuda_illegal_memory_access_in_watchdog.out")).reason == R.CUDA_ERROR


def test_policy_per_reason() -> None:
    """A lost GPU excludes the node (as an unkillable process does: supervisor.diagnosis.unkillable); OOM, NCCL and CUDA
    errors restart. Every reason is a failure of an attempt and a pre-created metric label."""
    assert EXCLUDES_NODE == {R.GPU_LOST, R.UNKILLABLE}
    for reason in {rule.reason for rule in RULES}:
        assert reason in ATTEMPT_FAILURES and reason.value in REASONS


def test_error_file_is_read_whole_and_preferred_to_the_output() -> None:
    report = read_error_file(DATA / "h200_torchrun_nccl_duplicate_gpu.error.json")
    assert report is not None and report.exit_code == 1 and "Duplicate GPU detected" in report.text
    oom = read_error_file(DATA / "h200_cuda_oom.error.json")
    assert oom is not None and oom.message.startswith("OutOfMemoryError: CUDA out of memory")
    found = find_gpu_failure(report.text, lines("h200_cuda_oom.out"), kernel_log=None)
    assert (found.reason, found.source) == (R.NCCL_ERROR, "error file"), found
    # The worker's exception is what ended it: a CUDA OOM in the output (handled, logged) is not read then.
    assert find_gpu_failure("ValueError: not a GPU's", lines("h200_cuda_oom.out"), kernel_log=None) is None


def test_a_handled_oom_then_an_error_file_value_error_is_not_cuda_oom(tmp_path: Path) -> None:
    """The reproduced case: the trainer caught a CUDA OOM and logged it, went on, then raised a ValueError
    that torchrun wrote to its error file: exit_code, the ValueError in the detail, no CUDA OOM."""
    error_file = tmp_path / "torchelastic_error.json"
    error_file.write_text('{"message": {"message": "ValueError: bad batch", "extraInfo": {}}, "errorCode": 1}')
    tail = ["[rank0] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (caught, retrying)",
            "step 12 loss 0.25"]
    r = _exit(1, tail, error_file=error_file)
    assert (r.reason, r.detail) == (R.EXIT_CODE, "exit code 1: ValueError: bad batch"), r


def _exit(code: int, tail: list[str], **kw: object):
    args = dict(last_step=7, job_pid=99, first_dead=None, oom_rose=False, stop_reason=None, kernel_log=None)
    args.update(kw)
    return classify_exit(2, code, tail=tail, **args)  # type: ignore[arg-type]


def test_classify_exit_with_the_recorded_torchrun_oom() -> None:
    """torchrun's exit 1 and its Root Cause report (rank, pid) with the error file's OOM: cuda_oom, the
    rank and pid kept, the matched line in the detail after what was there."""
    r = _exit(1, lines("h200_torchrun_cuda_oom.out"), error_file=DATA / "h200_torchrun_cuda_oom.error.json")
    assert (r.reason, r.exit_code, r.rank, r.pid) == (R.CUDA_OOM, 1, 0, 570), r
    assert r.detail.startswith("exit code 1 (rank 0, pid 570): OutOfMemoryError: CUDA out of memory"), r.detail
    assert "; CUDA out of memory (error file): OutOfMemoryError: CUDA out of memory. Tried to allocate 279.60 GiB" \
        in r.detail, r.detail


def test_what_the_gpu_rules_leave_alone() -> None:
    oom = lines("h200_cuda_oom.out")
    assert _exit(0, oom).reason == R.SUCCESS
    assert _exit(1, oom, stop_reason=R.STOPPED).reason == R.STOPPED
    assert _exit(1, oom, finished="done").reason == R.SUCCESS
    killed = _exit(-9, oom)  # a SIGKILL came from outside: what was printed before is not why it died
    assert (killed.reason, killed.signal) == (R.SIGNAL, "SIGKILL")
    assert _exit(-9, oom, oom_rose=True).reason == R.OOM  # the host's OOM killer stays the host's
    aborted = _exit(-6, lines("nccl_watchdog_timeout.out"))  # the watchdog aborts the process: SIGABRT
    assert (aborted.reason, aborted.signal) == (R.NCCL_ERROR, "SIGABRT"), aborted
    assert _exit(1, ["Traceback (most recent call last):", "ValueError: bad batch"]).reason == R.EXIT_CODE


def test_rank_death_reads_the_output() -> None:
    r = from_rank_death(1, RankDeath(1, 4242, 1, None), tail=lines("cuda_ecc_uncorrectable.out"), last_step=3,
                        oom_rose=False, kernel_log=None, probe=BROKEN)
    assert (r.reason, r.rank, r.exit_code) == (R.GPU_LOST, 1, 1), r
    assert "uncorrectable ECC error (output): RuntimeError: CUDA error: uncorrectable ECC error encountered" in r.detail
    assert "confirmed by the node check: GPU 0: not usable (GPU_IS_LOST" in r.detail, r.detail


# ------------------------------------------------------------ a text's lost GPU needs a second witness


def test_a_text_gpu_lost_needs_the_node_check_or_the_kernel() -> None:
    """A logged, retried ``CUDA error: unknown error`` is no proof the GPU is gone: without NVML's node check
    failing or a hardware Xid this attempt it is cuda_error (restarted, the node kept), the detail saying
    why; a CPU node or no NVML cannot confirm. The node check failing, or the kernel's Xid, confirms."""
    unknown = lines("cuda_unknown_error.out")
    for why, node in (("healthy", OURS), ("no NVML", NO_NVML)):
        r = _exit(1, unknown, probe=node)
        assert r.reason == R.CUDA_ERROR, (why, r)
        assert "CUDA unknown error (device lost) (output): RuntimeError: CUDA error: unknown error; gpu_lost not " \
            "confirmed (node check: " in r.detail and "restarted, the node kept" in r.detail, r.detail
    assert _exit(1, unknown, probe=BROKEN).reason == R.GPU_LOST
    with_xid = _exit(1, unknown, since=0.0, kernel_log=XID79, probe=OURS)
    assert with_xid.reason == R.GPU_LOST and "Xid 79 (kernel log)" in with_xid.detail, with_xid
    other = _exit(1, unknown, since=0.0, kernel_log=XID79, probe=OTHERS)  # another job's Xid confirms nothing
    assert other.reason == R.CUDA_ERROR, other
    # No NVML: the Xid's GPU cannot be told, but text and kernel agree (two witnesses) - confirmed.
    assert _exit(1, unknown, since=0.0, kernel_log=XID79, probe=NO_NVML).reason == R.GPU_LOST
    assert _exit(-9, unknown, probe=BROKEN).reason == R.SIGNAL  # a SIGKILL's output is still not read


def test_the_real_probe_on_this_node_cannot_confirm() -> None:
    """NVML's probe, unmocked, on this test machine: no GPU (or a healthy one) confirms nothing."""
    found = probe_node()
    assert found.broken is None, found


class _Nvml:
    """An NVML reader answering as a node of three GPUs (the hardware this machine lacks)."""

    def __init__(self, lost: int | None = None) -> None:
        self.gpus = [("GPU-aaaa", "00000000:3B:00.0"), ("GPU-bbbb", "00000000:44:00.0"), ("GPU-cccc", "00000000:CB:00.0")]
        self.lost = lost

    def count(self) -> int:
        return len(self.gpus)

    def handle(self, index: int) -> int:
        if index == self.lost:
            raise NvmlError("GPU_IS_LOST", "GPU is lost")
        return index

    def uuid(self, handle: int) -> str:
        return self.gpus[handle][0]

    def pci_bus_id(self, handle: int) -> str:
        return self.gpus[handle][1]

    def close(self) -> None:
        pass


def test_job_bus_ids_from_nvml() -> None:
    """The job's GPUs: those CUDA_VISIBLE_DEVICES names (NVML indices or UUIDs), all without it; unknown
    (None) where NVML cannot say, so a kernel fault is never taken for the job's on a guess."""
    assert job_bus_ids({}, lambda: _Nvml())[0] == ["00000000:3B:00.0", "00000000:44:00.0", "00000000:CB:00.0"]
    assert job_bus_ids({"CUDA_VISIBLE_DEVICES": "1"}, lambda: _Nvml())[0] == ["00000000:44:00.0"]
    assert job_bus_ids({"CUDA_VISIBLE_DEVICES": "GPU-cc,0"}, lambda: _Nvml())[0] == ["00000000:3B:00.0",
                                                                                    "00000000:CB:00.0"]
    assert job_bus_ids({"CUDA_VISIBLE_DEVICES": "MIG-1234"}, lambda: _Nvml())[0] is None
    assert job_bus_ids({}, lambda: _Nvml(lost=1))[0] is None
    assert pci_address("00000000:44:00.0") == pci_address("NVRM: Xid (PCI:0000:44:00): 79") == (0, 0x44, 0)
    assert job_bus_ids({}, _no_bindings)[0] is None


def _no_bindings() -> _Nvml:
    raise ImportError("No module named 'pynvml'")


# ------------------------------------------------------------ the kernel's Xid lines


def test_kernel_log_hardware_xids_from_the_attempts_start() -> None:
    """Stamps up to 5 s before the attempt's start count (the kernel's clock and CLOCK_MONOTONIC drift)."""
    xid79 = kernel_gpu_failure(since=1800.0, path=XID79)
    assert xid79 is not None and (xid79.reason, xid79.what, xid79.source) == (R.GPU_LOST, "Xid 79", "kernel log")
    assert xid79.line.startswith("NVRM: Xid (PCI:0000:44:00): 79,") and xid79.pci == (0, 0x44, 0), xid79
    assert kernel_gpu_failure(since=1848.0, path=XID79) is not None  # 4.7 s early: the margin
    assert kernel_gpu_failure(since=1849.0, path=XID79) is None  # before this attempt: not its
    assert kernel_gpu_failure(since=1900.0, path=XID79) is None
    assert kernel_gpu_failure(since=0.0, path=DATA / "dmesg_xid48.txt").what == "Xid 48"
    lost = kernel_gpu_failure(since=1843.0, path=DATA / "dmesg_fallen_off_no_xid.txt")  # continuation lines
    assert lost is not None and lost.what == "GPU has fallen off the bus", lost
    assert lost.pci == (0, 0xb3, 0), lost  # the message's first line names the GPU
    assert kernel_gpu_failure(since=1849.0, path=DATA / "dmesg_fallen_off_no_xid.txt") is None
    for benign in ("h200_dmesg_xid43.txt", "dmesg_xid_application.txt"):  # an application's Xid: not the node's
        assert kernel_gpu_failure(since=0.0, path=DATA / benign) is None, benign
    assert kernel_gpu_failure(since=0.0, path=DATA / "no-such-log") is None


def test_the_real_kernel_log_is_read_without_blocking() -> None:
    """/dev/kmsg blocks a plain read at its end; this returns (None: no GPU fault since now), readable or not."""
    assert kernel_gpu_failure(since=time.monotonic(), path="/dev/kmsg") is None


def test_the_kernel_word_wins_and_counts_even_for_a_sigkill() -> None:
    """A GPU that fell off the bus leaves ranks printing NCCL errors or dying of signals: the kernel's Xid
    names the cause. Without ``since`` (an attempt start) the kernel log is not read."""
    nccl = lines("nccl_watchdog_timeout.out")
    r = _exit(1, nccl, since=0.0, kernel_log=XID79, probe=OURS)
    assert r.reason == R.GPU_LOST and "Xid 79 (kernel log): NVRM: Xid (PCI:0000:44:00): 79" in r.detail, r
    assert _exit(-9, nccl, since=0.0, kernel_log=XID79, probe=OURS).reason == R.GPU_LOST
    assert _exit(1, nccl, kernel_log=XID79, probe=OURS).reason == R.NCCL_ERROR
    death = from_rank_death(1, RankDeath(0, 11, None, "SIGKILL"), tail=[], last_step=None, oom_rose=False,
                            since=0.0, kernel_log=XID79, probe=OURS)
    assert death.reason == R.GPU_LOST


def test_another_jobs_xid_is_not_ours() -> None:
    """On a shared node the Xid's PCI address is another job's GPU: not this job's ending. Where the job's
    GPUs cannot be known (no NVML) an Xid alone never excludes the node: cuda_error (or what the text
    says), the Xid in the detail; with the node check failing it is this node's lost GPU."""
    nccl = lines("nccl_watchdog_timeout.out")
    other = _exit(1, nccl, since=0.0, kernel_log=XID79, probe=OTHERS)
    assert other.reason == R.NCCL_ERROR and "Xid" not in other.detail, other
    assert _exit(1, ["ValueError: bad batch"], since=0.0, kernel_log=XID79, probe=OTHERS).reason == R.EXIT_CODE
    unknown = _exit(1, ["ValueError: bad batch"], since=0.0, kernel_log=XID79, probe=NO_NVML)
    assert unknown.reason == R.CUDA_ERROR, unknown
    assert "Xid 79 (kernel log) on a GPU not known to be this job's (NVML unavailable" in unknown.detail, unknown
    assert "not excluding the node on it" in unknown.detail
    noted = _exit(1, nccl, since=0.0, kernel_log=XID79, probe=NO_NVML)
    assert noted.reason == R.NCCL_ERROR and "Xid 79 (kernel log) on a GPU not known" in noted.detail, noted
    killed = _exit(-9, [], since=0.0, kernel_log=XID79, probe=NO_NVML)
    assert killed.reason == R.CUDA_ERROR, killed
    lost = _exit(1, nccl, since=0.0, kernel_log=XID79, probe=probe(None, "GPU 1: not usable (GPU_IS_LOST)"))
    assert lost.reason == R.GPU_LOST and "node check: GPU 1: not usable" in lost.detail, lost


# ------------------------------------------------------------ a hang with this job's GPU lost


def _hang(reason: EndReason = R.HANG) -> AttemptResult:
    return AttemptResult(3, reason, None, rank=1, pid=77, detail="rank 1 (pid 77) silent for 31.00s > heartbeat "
                         "timeout 30.00s", output_tail=lines("cuda_unknown_error.out"))


def test_a_hang_with_this_jobs_gpu_lost_is_gpu_lost() -> None:
    """A GPU fallen off the bus leaves a collective hung: the kernel's Xid on the job's GPU makes the hang
    gpu_lost, the hang's detail kept; another job's Xid, none, or the output's text leave it a hang."""
    r = with_hang_gpu_failure(_hang(), since=0.0, kernel_log=XID79, probe=OURS)
    assert r.reason == R.GPU_LOST and r.detail.startswith("rank 1 (pid 77) silent for 31.00s"), r
    assert "; Xid 79 (kernel log): NVRM: Xid (PCI:0000:44:00): 79" in r.detail, r.detail
    assert with_hang_gpu_failure(_hang(R.STARTUP_TIMEOUT), since=0.0, kernel_log=XID79, probe=OURS).reason \
        == R.GPU_LOST
    assert with_hang_gpu_failure(_hang(), since=0.0, kernel_log=XID79, probe=OTHERS).detail == _hang().detail
    unknown = with_hang_gpu_failure(_hang(), since=0.0, kernel_log=XID79, probe=NO_NVML)
    assert unknown.reason == R.HANG and "not excluding the node on it" in unknown.detail, unknown
    assert with_hang_gpu_failure(_hang(), since=1900.0, kernel_log=XID79, probe=OURS).reason == R.HANG
    assert with_hang_gpu_failure(_hang(), since=0.0, kernel_log=None, probe=BROKEN).reason == R.HANG  # no text


# ------------------------------------------------------------ the run loop's policy


def _loop_printing(tmp_path: Path, text: list[str], monkeypatch: pytest.MonkeyPatch):
    """The fake run loop whose first attempt prints ``text`` and exits 1 after a save, the second succeeds."""
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-node-7")  # what rlsup calls this node
    printed: dict[str, object] = {}
    first = Attempt(exit_code=1, saves=2, on_tick=(1, lambda: printed["layer"].jobs[-1].output.lines.extend(text)))
    sup, layer, recorder = make(tmp_path, first, Attempt(exit_code=0))
    printed["layer"] = layer
    return sup, layer, recorder


def test_run_loop_printed_ecc_unconfirmed_restarts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Text alone never excludes a node: on this machine NVML's node check (the real probe) cannot confirm
    the printed ECC error, so the attempt is cuda_error and restarted here."""
    sup, layer, recorder = _loop_printing(tmp_path, lines("cuda_ecc_uncorrectable.out"), monkeypatch)
    assert sup.run().exit_code == 0
    assert len(layer.jobs) == 2 and recorder.failures == ["cuda_error"]
    (inc,) = incidents(tmp_path)
    assert (inc["reason"], inc["action"]) == ("cuda_error", "restart") and "gpu_lost not confirmed" in inc["detail"]
    assert read_unhealthy(tmp_path / "state") == []


def test_run_loop_hang_on_a_lost_gpu_stops_with_77_and_names_the_node(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks hang (a collective on a GPU that fell off the bus); the kernel logged Xid 79 for the job's
    GPU while the attempt ran: gpu_lost, no restart on this node, exit 77, the node in unhealthy_nodes."""
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-node-7")
    kmsg = tmp_path / "kmsg"
    xid = "NVRM: Xid (PCI:0000:44:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."

    def kernel_logs() -> None:  # stamped now: inside this attempt
        kmsg.write_text(f"4,2302,{int(time.monotonic() * 1e6)},-;{xid}\n")

    sup, layer, recorder = make(tmp_path, Attempt(exit_code=None, hang_at=3, on_tick=(2, kernel_logs)),
                                Attempt(exit_code=0))
    sup.kernel_log, sup.gpu_probe = kmsg, OURS
    result = sup.run()
    assert result.exit_code == exit_codes.UNHEALTHY == 77 and result.status == "gave_up", result
    assert len(layer.jobs) == 1 and recorder.failures == ["gpu_lost"]  # no restart on this node; counted
    (inc,) = incidents(tmp_path)
    assert (inc["reason"], inc["action"], inc["suspect_nodes"]) == ("gpu_lost", "exclude_node", ["gpu-node-7"]), inc
    assert "silent for" in inc["detail"] and f"Xid 79 (kernel log): {xid}" in inc["detail"], inc
    assert read_unhealthy(tmp_path / "state") == ["gpu-node-7"]


def test_run_loop_cuda_oom_restarts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sup, layer, recorder = _loop_printing(tmp_path, lines("h200_cuda_oom.out"), monkeypatch)
    assert sup.run().exit_code == 0
    assert len(layer.jobs) == 2 and recorder.failures == ["cuda_oom"]
    (inc,) = incidents(tmp_path)
    assert (inc["reason"], inc["action"]) == ("cuda_oom", "restart"), inc
    assert read_unhealthy(tmp_path / "state") == []
