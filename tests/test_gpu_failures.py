"""supervisor.gpu_failures and its use in supervisor.attempt_end: GPU-era failures (CUDA OOM, NCCL error or
timeout, CUDA error, a GPU lost) told apart by the texts real jobs print (tests/data/gpu_errors/, each file's
source in its README: recorded on an H200, or from public issue threads), the structured error file before
the output, the kernel's Xid lines read from a log file, and the run loop's answer to a lost GPU (exit 77)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from support.fake_run_loop import Attempt, incidents, make
from supervisor import exit_codes
from supervisor.attempt_end import classify_exit, from_rank_death, read_error_file
from supervisor.gpu_failures import RULES, classify_text, find_gpu_failure, kernel_gpu_failure
from supervisor.health import read_unhealthy
from supervisor.lifecycle import ATTEMPT_FAILURES, EXCLUDES_NODE, EndReason
from supervisor.metrics import REASONS
from supervisor.rank_deaths import RankDeath

DATA = Path(__file__).resolve().parent / "data" / "gpu_errors"
R = EndReason


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
    ("RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable", R.GPU_LOST),
    ("RuntimeError: CUDA error: GPU has fallen off the bus", R.GPU_LOST),
    ("[rank3]: torch.distributed.DistBackendError: NCCL communicator was aborted on rank 3.", R.NCCL_ERROR),
    ("ncclInternalError: Internal check failed.", R.NCCL_ERROR),
    ("Traceback (most recent call last):\nValueError: bad batch", None),
    ("step 3 loss 0.25 (no CUDA here; nccl tuning notes)", None),
])
def test_texts_from_the_libraries(text: str, reason: EndReason | None) -> None:
    found = classify_text(text.splitlines())
    assert (found.reason if found else None) == reason, found


def test_the_table_decides_not_the_line_order() -> None:
    """All ranks print into one output: a rank's OOM and its peers' NCCL timeout, in any order, is the OOM;
    an ECC error before a later OOM is the ECC error."""
    mixed = lines("nccl_watchdog_timeout.out") + lines("h200_cuda_oom.out")
    assert classify_text(mixed).reason == R.CUDA_OOM
    assert classify_text(lines("h200_cuda_oom.out") + lines("cuda_ecc_uncorrectable.out")).reason == R.GPU_LOST


def test_policy_per_reason() -> None:
    """A lost GPU excludes the node; OOM, NCCL and CUDA errors restart. Every reason is a failure of an attempt
    and a pre-created metric label."""
    assert EXCLUDES_NODE == {R.GPU_LOST}
    for reason in {rule.reason for rule in RULES}:
        assert reason in ATTEMPT_FAILURES and reason.value in REASONS


def test_error_file_is_read_whole_and_preferred_to_the_output() -> None:
    report = read_error_file(DATA / "h200_torchrun_nccl_duplicate_gpu.error.json")
    assert report is not None and report.exit_code == 1 and "Duplicate GPU detected" in report.text
    oom = read_error_file(DATA / "h200_cuda_oom.error.json")
    assert oom is not None and oom.message.startswith("OutOfMemoryError: CUDA out of memory")
    found = find_gpu_failure(report.text, lines("h200_cuda_oom.out"), kernel_log=None)
    assert (found.reason, found.source) == (R.NCCL_ERROR, "error file"), found
    assert find_gpu_failure("ValueError: not a GPU's", lines("h200_cuda_oom.out"), kernel_log=None).reason == R.CUDA_OOM


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
                        oom_rose=False, kernel_log=None)
    assert (r.reason, r.rank, r.exit_code) == (R.GPU_LOST, 1, 1), r
    assert "uncorrectable ECC error (output): RuntimeError: CUDA error: uncorrectable ECC error encountered" in r.detail


# ------------------------------------------------------------ the kernel's Xid lines


def test_kernel_log_hardware_xids_from_the_attempts_start() -> None:
    xid79 = kernel_gpu_failure(since=1800.0, path=DATA / "kmsg_xid79.txt")
    assert xid79 is not None and (xid79.reason, xid79.what, xid79.source) == (R.GPU_LOST, "Xid 79", "kernel log")
    assert xid79.line.startswith("NVRM: Xid (PCI:0000:44:00): 79,"), xid79
    assert kernel_gpu_failure(since=1900.0, path=DATA / "kmsg_xid79.txt") is None  # before this attempt: not its
    assert kernel_gpu_failure(since=0.0, path=DATA / "dmesg_xid48.txt").what == "Xid 48"
    lost = kernel_gpu_failure(since=1843.0, path=DATA / "dmesg_fallen_off_no_xid.txt")  # continuation lines
    assert lost is not None and lost.what == "GPU has fallen off the bus", lost
    assert kernel_gpu_failure(since=1844.0, path=DATA / "dmesg_fallen_off_no_xid.txt") is None
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
    r = _exit(1, nccl, since=0.0, kernel_log=DATA / "kmsg_xid79.txt")
    assert r.reason == R.GPU_LOST and "Xid 79 (kernel log): NVRM: Xid (PCI:0000:44:00): 79" in r.detail, r
    assert _exit(-9, nccl, since=0.0, kernel_log=DATA / "kmsg_xid79.txt").reason == R.GPU_LOST
    assert _exit(1, nccl, kernel_log=DATA / "kmsg_xid79.txt").reason == R.NCCL_ERROR
    death = from_rank_death(1, RankDeath(0, 11, None, "SIGKILL"), tail=[], last_step=None, oom_rose=False,
                            since=0.0, kernel_log=DATA / "kmsg_xid79.txt")
    assert death.reason == R.GPU_LOST


# ------------------------------------------------------------ the run loop's policy


def _loop_printing(tmp_path: Path, text: list[str], monkeypatch: pytest.MonkeyPatch):
    """The fake run loop whose first attempt prints ``text`` and exits 1 after a save, the second succeeds."""
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-node-7")  # what rlsup calls this node
    printed: dict[str, object] = {}
    first = Attempt(exit_code=1, saves=2, on_tick=(1, lambda: printed["layer"].jobs[-1].output.lines.extend(text)))
    sup, layer, recorder = make(tmp_path, first, Attempt(exit_code=0))
    printed["layer"] = layer
    return sup, layer, recorder


def test_run_loop_lost_gpu_stops_with_77_and_names_the_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sup, layer, recorder = _loop_printing(tmp_path, lines("cuda_ecc_uncorrectable.out"), monkeypatch)
    result = sup.run()
    assert result.exit_code == exit_codes.UNHEALTHY == 77 and result.status == "gave_up", result
    assert len(layer.jobs) == 1 and recorder.failures == ["gpu_lost"]  # no restart on this node; counted
    (inc,) = incidents(tmp_path)
    assert (inc["reason"], inc["action"], inc["suspect_nodes"]) == ("gpu_lost", "exclude_node", ["gpu-node-7"]), inc
    assert read_unhealthy(tmp_path / "state") == ["gpu-node-7"]


def test_run_loop_cuda_oom_restarts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sup, layer, recorder = _loop_printing(tmp_path, lines("h200_cuda_oom.out"), monkeypatch)
    assert sup.run().exit_code == 0
    assert len(layer.jobs) == 2 and recorder.failures == ["cuda_oom"]
    (inc,) = incidents(tmp_path)
    assert (inc["reason"], inc["action"]) == ("cuda_oom", "restart"), inc
    assert read_unhealthy(tmp_path / "state") == []
