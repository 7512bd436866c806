"""``pre_launch_check: builtin``: this node's GPUs through NVML, before every attempt.

A site without its own check still should not relaunch onto a GPU that fell off the bus or carries an
uncorrectable memory error: the attempt would fail again and cost the whole job each round. NVML answers
in milliseconds (``dcgmi diag`` takes minutes), so the check is cheap enough for every attempt. A node
fails it when NVML sees fewer GPUs than the job asks for, a GPU's handle cannot be had (the GPU is lost),
a page retirement or a row remap is pending (the GPU needs a reset), row remapping failed, or a GPU
counts uncorrected ECC errors since the driver loaded. Where a query is not supported (consumer GPUs
have no ECC, pre-Ampere GPUs no row remapping) it is skipped and said.

The decision (:func:`evaluate`) reads NVML through a small :class:`NvmlReader`, so it is tested with
NVML-like answers on machines without GPUs; :class:`PynvmlReader` is the thin real one. ``pynvml``
(the ``nvidia-ml-py`` package) is an optional import: rlsup's core install may lack it. A node without
it, or whose NVML cannot load, passes with "no GPUs: skipped" only when it has no ``/dev/nvidia<N>``
device files; with GPU devices present it fails, naming what is missing (a check that silently did
nothing on a GPU node would be worse than none).
"""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

#: NVML error names (``NVML_ERROR_<NAME>``) meaning "this GPU or driver cannot answer that": skipped.
UNSUPPORTED = frozenset({"NOT_SUPPORTED", "NO_PERMISSION", "FUNCTION_NOT_FOUND"})
#: NVML init errors that mean no NVIDIA driver on this node (a CPU node when no device files exist).
NO_DRIVER = frozenset({"LIBRARY_NOT_FOUND", "DRIVER_NOT_LOADED"})
TORCHRUN_NPROC = ("--nproc-per-node", "--nproc_per_node")
INSTALL_HINT = "pip install nvidia-ml-py into rlsup's environment"


class NvmlError(Exception):
    """An NVML call failed; ``name`` is NVML's error name without ``NVML_ERROR_`` (``GPU_IS_LOST``)."""

    def __init__(self, name: str, message: str = "") -> None:
        super().__init__(message or name)
        self.name = name


class NvmlReader(Protocol):
    """The NVML questions the check asks; each raises :class:`NvmlError` when NVML does."""

    def count(self) -> int: ...

    def handle(self, index: int) -> Any: ...

    def retired_pages_pending(self, handle: Any) -> bool: ...

    def uncorrected_ecc(self, handle: Any) -> int: ...

    def remapped_rows(self, handle: Any) -> tuple[bool, bool]:
        """(pending, failure)."""
        ...

    def close(self) -> None: ...


@dataclass
class GpuHealth:
    """The check's answer: pass or fail, one line for the log, and every reason found."""

    ok: bool
    detail: str
    seconds: float = 0.0
    reasons: list[str] = field(default_factory=list)
    gpus: int | None = None  # what NVML saw; None: not asked (no NVML)


def asked_gpus(command: Sequence[str], environ: Mapping[str, str]) -> tuple[int | None, str]:
    """How many GPUs the job asks this node for, and from where: torchrun's numeric ``--nproc-per-node``,
    else ``CUDA_VISIBLE_DEVICES``; (None, why not) when neither says (the count is then not checked)."""
    for i, arg in enumerate(command):
        if arg.endswith(".py"):
            break  # the training script: what follows is the trainer's own
        name, eq, value = arg.partition("=")
        if name in TORCHRUN_NPROC:
            value = value if eq else (command[i + 1] if i + 1 < len(command) else "")
            if value.isdigit():
                return int(value), f"--nproc-per-node {value}"
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        entries = [e for e in visible.split(",") if e.strip()]
        return len(entries), f"CUDA_VISIBLE_DEVICES={visible}"
    return None, "no numeric --nproc-per-node or CUDA_VISIBLE_DEVICES"


def gpu_device_files() -> list[str]:
    """``/dev/nvidia<N>``: the driver's per-GPU device files (not nvidiactl, nvidia-uvm)."""
    return sorted(p for p in glob.glob("/dev/nvidia*") if p[len("/dev/nvidia"):].isdigit())


def evaluate(reader: NvmlReader, asked: int | None, source: str = "") -> GpuHealth:
    """Every reason this node's GPUs are unfit, read through ``reader`` (NVML initialised)."""
    reasons, notes = [], []
    try:
        count = reader.count()
    except NvmlError as e:
        return GpuHealth(False, f"NVML cannot count GPUs ({e.name})", reasons=[f"nvmlDeviceGetCount: {e}"])
    if asked is not None and count < asked:
        reasons.append(f"{count} GPU(s) visible to NVML, the job asks for {asked} ({source})")
    for index in range(count):
        try:
            handle = reader.handle(index)
        except NvmlError as e:
            reasons.append(f"GPU {index}: not usable ({e.name}: {e})")
            continue
        reasons += _device_reasons(reader, index, handle, notes)
    if reasons:
        return GpuHealth(False, "; ".join(reasons), reasons=reasons, gpus=count)
    asked_text = f", {asked} asked ({source})" if asked is not None else ""
    skipped = f"; not measured: {', '.join(sorted(set(notes)))}" if notes else ""
    return GpuHealth(True, f"{count} GPU(s) healthy{asked_text}{skipped}", reasons=[], gpus=count)


def _device_reasons(reader: NvmlReader, index: int, handle: Any, notes: list[str]) -> list[str]:
    """One GPU's failures (a query it does not support is noted in ``notes`` instead)."""
    out: list[str] = []
    pending = _ask(lambda: reader.retired_pages_pending(handle), index, "retired pages", out, notes)
    if pending:
        out.append(f"GPU {index}: page retirement pending (needs a GPU reset)")
    ecc = _ask(lambda: reader.uncorrected_ecc(handle), index, "ECC errors", out, notes)
    if ecc:
        out.append(f"GPU {index}: {ecc} uncorrected ECC error(s) since the driver loaded")
    rows = _ask(lambda: reader.remapped_rows(handle), index, "remapped rows", out, notes)
    if rows is not None:
        if rows[1]:
            out.append(f"GPU {index}: row remapping failed")
        if rows[0]:
            out.append(f"GPU {index}: row remap pending (needs a GPU reset)")
    return out


def _ask(query: Callable[[], Any], index: int, what: str, reasons: list[str], notes: list[str]) -> Any:
    """``query()``'s answer; None when NVML does not answer (unsupported: noted; anything else: a reason)."""
    try:
        return query()
    except NvmlError as e:
        if e.name in UNSUPPORTED:
            notes.append(what)
        else:
            reasons.append(f"GPU {index}: {what} unreadable ({e.name}: {e})")
        return None


def check_gpus(command: Sequence[str] = (), environ: Mapping[str, str] | None = None,
               reader: Callable[[], NvmlReader] | None = None, devices: Sequence[str] | None = None) -> GpuHealth:
    """The builtin check on this node: NVML's answers through ``reader`` (opens one; default: pynvml's),
    or a CPU node's "no GPUs: skipped". ``devices``: the GPU device files (default: this node's)."""
    start = time.monotonic()
    environ = os.environ if environ is None else environ
    asked, source = asked_gpus(command, environ)
    result = _check(reader or PynvmlReader.open, asked, source,
                    gpu_device_files() if devices is None else list(devices))
    result.seconds = time.monotonic() - start
    return result


def _check(open_reader: Callable[[], NvmlReader], asked: int | None, source: str, devices: list[str]) -> GpuHealth:
    try:
        reader = open_reader()
    except ImportError as e:
        if not devices:
            return GpuHealth(True, "no GPUs: skipped (no NVML bindings, no /dev/nvidia<N>)")
        return GpuHealth(False, f"NVML bindings missing ({e}) but GPUs are present ({devices[0]}): "
                                f"{INSTALL_HINT}, or name a pre_launch_check command", reasons=[str(e)])
    except NvmlError as e:
        if e.name in NO_DRIVER and not devices:
            return GpuHealth(True, f"no GPUs: skipped (NVML: {e.name}, no /dev/nvidia<N>)")
        return GpuHealth(False, f"NVML did not initialise ({e.name}: {e})"
                                + (f" but GPUs are present ({devices[0]})" if devices else ""), reasons=[str(e)])
    try:
        return evaluate(reader, asked, source)
    finally:
        reader.close()


class PynvmlReader:
    """:class:`NvmlReader` over ``pynvml`` (nvidia-ml-py); :meth:`open` initialises NVML."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml

    @classmethod
    def open(cls) -> "PynvmlReader":
        """Raise ImportError (no bindings) or :class:`NvmlError` (NVML would not initialise)."""
        import pynvml

        reader = cls(pynvml)
        reader._call(pynvml.nvmlInit)
        return reader

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self.nvml.NVMLError as e:
            raise NvmlError(self._name(e.value), str(e)) from e

    def _name(self, code: int) -> str:
        for attr in dir(self.nvml):
            if attr.startswith("NVML_ERROR_") and getattr(self.nvml, attr) == code:
                return attr[len("NVML_ERROR_"):]
        return f"code {code}"

    def count(self) -> int:
        return int(self._call(self.nvml.nvmlDeviceGetCount))

    def handle(self, index: int) -> Any:
        return self._call(self.nvml.nvmlDeviceGetHandleByIndex, index)

    def retired_pages_pending(self, handle: Any) -> bool:
        return bool(self._call(self.nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle))

    def uncorrected_ecc(self, handle: Any) -> int:
        n = self.nvml
        return int(self._call(n.nvmlDeviceGetTotalEccErrors, handle, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                              n.NVML_VOLATILE_ECC))

    def remapped_rows(self, handle: Any) -> tuple[bool, bool]:
        _corr, _unc, pending, failure = self._call(self.nvml.nvmlDeviceGetRemappedRows, handle)
        return bool(pending), bool(failure)

    def pci_bus_id(self, handle: Any) -> str:
        """``00000000:3B:00.0`` (NVML's ``busId``)."""
        bus = self._call(self.nvml.nvmlDeviceGetPciInfo, handle).busId
        return bus.decode() if isinstance(bus, bytes) else str(bus)

    def uuid(self, handle: Any) -> str:
        found = self._call(self.nvml.nvmlDeviceGetUUID, handle)
        return found.decode() if isinstance(found, bytes) else str(found)


def job_bus_ids(environ: Mapping[str, str] | None = None,
                reader: Callable[[], Any] | None = None) -> tuple[list[str] | None, str]:
    """The PCI bus ids (NVML's ``busId``) of the GPUs this node's job uses: those ``CUDA_VISIBLE_DEVICES``
    names (indices are NVML's, the PCI order, which CUDA's own matches on a node of one GPU model; ``GPU-``
    UUIDs or their prefixes), all NVML sees when it is unset. (None, why) when NVML cannot say (no
    bindings, no driver, a MIG or other name), so that a caller never takes another job's GPU for its own.
    ``reader`` opens a reader with ``count``, ``handle``, ``pci_bus_id`` and ``uuid`` (default: pynvml's)."""
    environ = os.environ if environ is None else environ
    visible = [e.strip() for e in (environ.get("CUDA_VISIBLE_DEVICES") or "").split(",") if e.strip()]
    if visible and not all(e.isdigit() or e.startswith("GPU-") for e in visible):
        return None, f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']} names no GPU index or UUID"
    try:
        nvml = (reader or PynvmlReader.open)()
    except (ImportError, NvmlError) as e:
        return None, f"NVML unavailable ({type(e).__name__}: {e})"
    try:
        gpus = [(str(i), nvml.uuid(h), nvml.pci_bus_id(h)) for i in range(nvml.count()) for h in [nvml.handle(i)]]
    except NvmlError as e:
        return None, f"NVML cannot list the GPUs ({e.name}: {e})"
    finally:
        nvml.close()
    if not visible:
        return [bus for _i, _u, bus in gpus], f"all {len(gpus)} GPU(s) NVML sees"
    chosen = [bus for index, uuid, bus in gpus if any(e == index or uuid.startswith(e) for e in visible)]
    return chosen, f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']}"
