"""``pre_launch_check: builtin`` (issue 30): rlsup's own NVML check of this node's GPUs before every attempt.

NVML cannot run here (no GPU), so the decision is fed NVML-like answers through a reader object passed in
(:class:`FakeNvml`, the same questions :class:`supervisor.diagnosis.gpu_health.PynvmlReader` asks pynvml); the
real reader runs on a GPU machine (tests/gpu/test_gpu_e2e.py). ``rlsup run`` with the builtin check runs
for real: on this CPU node it says "no GPUs: skipped" and the job runs to its end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest


from supervisor.config import load_config
from supervisor.diagnosis.gpu_health import NvmlError, asked_gpus, check_gpus, evaluate, gpu_device_files
from supervisor.run.node_health import BUILTIN, check_node

TORCHRUN = ["torchrun", "--standalone", "--nproc-per-node", "2", "train.py", "--nproc-per-node", "7"]


@dataclass
class Gpu:
    """One GPU's NVML answers; a field set to an error name makes that query raise it."""

    lost: str = ""
    retired_pending: bool | str = False
    ecc: int | str = 0
    rows: tuple[bool, bool] | str = (False, False)


@dataclass
class FakeNvml:
    """NVML-like answers for :func:`evaluate` (an :class:`~supervisor.diagnosis.gpu_health.NvmlReader`)."""

    gpus: list[Gpu] = field(default_factory=list)
    count_error: str = ""
    closed: bool = False

    def count(self) -> int:
        if self.count_error:
            raise NvmlError(self.count_error)
        return len(self.gpus)

    def handle(self, index: int) -> Gpu:
        if self.gpus[index].lost:
            raise NvmlError(self.gpus[index].lost, "GPU is lost")
        return self.gpus[index]

    @staticmethod
    def _answer(value: object) -> object:
        if isinstance(value, str):
            raise NvmlError(value)
        return value

    def retired_pages_pending(self, handle: Gpu) -> bool:
        return bool(self._answer(handle.retired_pending))

    def uncorrected_ecc(self, handle: Gpu) -> int:
        return int(self._answer(handle.ecc))  # type: ignore[call-overload]

    def remapped_rows(self, handle: Gpu) -> tuple[bool, bool]:
        return self._answer(handle.rows)  # type: ignore[return-value]

    def close(self) -> None:
        self.closed = True


def test_healthy_gpus_pass_and_say_what_was_not_measured() -> None:
    nvml = FakeNvml([Gpu(), Gpu(rows="NOT_SUPPORTED", ecc="NOT_SUPPORTED")])
    result = evaluate(nvml, 2, "--nproc-per-node 2")
    assert result.ok and result.gpus == 2 and result.reasons == [], result
    assert result.detail == "2 GPU(s) healthy, 2 asked (--nproc-per-node 2); not measured: ECC errors, remapped rows"


def test_every_bad_gpu_state_is_a_reason() -> None:
    nvml = FakeNvml([Gpu(lost="GPU_IS_LOST"), Gpu(retired_pending=True), Gpu(ecc=3), Gpu(rows=(True, False)),
                     Gpu(rows=(False, True)), Gpu(ecc="UNKNOWN"), Gpu()])
    result = evaluate(nvml, 8, "--nproc-per-node 8")
    assert not result.ok
    assert result.reasons == [
        "7 GPU(s) visible to NVML, the job asks for 8 (--nproc-per-node 8)",
        "GPU 0: not usable (GPU_IS_LOST: GPU is lost)",
        "GPU 1: page retirement pending (needs a GPU reset)",
        "GPU 2: 3 uncorrected ECC error(s) since the driver loaded",
        "GPU 3: row remap pending (needs a GPU reset)",
        "GPU 4: row remapping failed",
        "GPU 5: ECC errors unreadable (UNKNOWN: UNKNOWN)",
    ]
    assert result.detail == "; ".join(result.reasons)


def test_a_query_that_says_the_gpu_is_lost_fails() -> None:
    result = evaluate(FakeNvml([Gpu(retired_pending="GPU_IS_LOST")]), None)
    assert not result.ok and result.reasons == ["GPU 0: retired pages unreadable (GPU_IS_LOST: GPU_IS_LOST)"]


def test_more_gpus_than_asked_and_no_count_asked_pass() -> None:
    assert evaluate(FakeNvml([Gpu()] * 8), 4, "--nproc-per-node 4").ok
    result = evaluate(FakeNvml([Gpu()] * 2), None)
    assert result.ok and result.detail == "2 GPU(s) healthy"
    count = evaluate(FakeNvml(count_error="UNINITIALIZED"), 1)
    assert not count.ok and count.detail == "NVML cannot count GPUs (UNINITIALIZED)"


def test_the_asked_count_comes_from_torchrun_else_cuda_visible_devices() -> None:
    assert asked_gpus(TORCHRUN, {}) == (2, "--nproc-per-node 2")  # the trainer's own flag after train.py is not read
    assert asked_gpus(["torchrun", "--nproc_per_node=4", "-m", "pkg.train"], {}) == (4, "--nproc-per-node 4")
    visible = {"CUDA_VISIBLE_DEVICES": "0,1,2"}
    assert asked_gpus(["torchrun", "--nproc-per-node", "gpu", "t.py"], visible) == (3, "CUDA_VISIBLE_DEVICES=0,1,2")
    assert asked_gpus(["python", "train.py"], {"CUDA_VISIBLE_DEVICES": ""}) == (
        None, "no numeric --nproc-per-node or CUDA_VISIBLE_DEVICES")


def _no_bindings() -> FakeNvml:
    raise ImportError("No module named 'pynvml'")


def _no_driver() -> FakeNvml:
    raise NvmlError("DRIVER_NOT_LOADED", "Driver Not Loaded")


@pytest.mark.parametrize("opener", [_no_bindings, _no_driver])
def test_cpu_node_is_skipped_and_a_gpu_node_without_nvml_fails(opener: object) -> None:
    cpu = check_gpus(TORCHRUN, {}, reader=opener, devices=[])  # type: ignore[arg-type]
    assert cpu.ok and cpu.detail.startswith("no GPUs: skipped"), cpu
    gpu = check_gpus(TORCHRUN, {}, reader=opener, devices=["/dev/nvidia0"])  # type: ignore[arg-type]
    assert not gpu.ok and "GPUs are present (/dev/nvidia0)" in gpu.detail, gpu
    if opener is _no_bindings:
        assert "pip install nvidia-ml-py" in gpu.detail


def test_nvml_opened_through_the_reader_is_closed_and_its_answer_returned() -> None:
    nvml = FakeNvml([Gpu(ecc=1)])
    result = check_gpus(["torchrun", "--nproc-per-node", "1", "t.py"], {}, reader=lambda: nvml, devices=[])
    assert nvml.closed and not result.ok and result.gpus == 1 and result.seconds >= 0
    assert result.reasons == ["GPU 0: 1 uncorrected ECC error(s) since the driver loaded"]


def test_builtin_is_a_value_of_pre_launch_check_from_flag_env_or_file() -> None:
    assert load_config(environ={"RLSUP_PRE_LAUNCH_CHECK": BUILTIN}).config.pre_launch_check == BUILTIN
    if gpu_device_files():
        pytest.skip("this node has GPUs: the CPU path is not what runs here")
    assert check_node(BUILTIN, 10, 0, "n0", TORCHRUN) is None  # this CPU node: skipped, healthy


