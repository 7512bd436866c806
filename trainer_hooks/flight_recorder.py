"""PyTorch Flight Recorder dumps on rlsup's request, from a thread that waits on a FIFO.

Why a thread on a FIFO: in a hung collective the main thread sits in C++ (``all_reduce`` waiting on a
peer) with the GIL released, so a Python signal handler would never run. A daemon thread blocked in
``os.read`` on a named pipe beside the heartbeat file costs nothing while no request comes (no
polling, no wake-ups) and runs at once when rlsup writes a byte into it. The dump is torch's own
(``_dump_fr_trace_json``), written next to the heartbeat file with one atomic rename.

torch records collectives only when its buffer size is set (``TORCH_FR_BUFFER_SIZE``, or
``TORCH_NCCL_TRACE_BUFFER_SIZE``): rlsup sets it for supervised jobs unless the user did; with both 0
no listener starts. gloo's dumps name no process group in ``pg_config`` (torch 2.13 writes one entry
with an empty name), so the rank adds its own view of its groups (``rlsup_pg_config``: name,
description and global ranks) for the analysis on rlsup's side.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlsup_format.heartbeat_record import fr_dump_name, fr_request_name

BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


@dataclass
class _Listener:
    """The one listener of this process: its thread, the FIFO's descriptor, and the flag that ends it."""

    thread: threading.Thread
    fd: int
    stop: threading.Event


_listener: _Listener | None = None


def recording() -> bool:
    """Whether torch's Flight Recorder is on in this process's environment (a buffer size above 0)."""
    for name in BUFFER_ENV:
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value) > 0
            except ValueError:
                return False
    return False


def start_listener(directory: Path, rank: int) -> bool:
    """Make the request FIFO for ``rank`` in ``directory`` and start the thread that answers it (once
    per process, only where the Flight Recorder records). False where none was started: this is called
    from the trainer's heartbeat, so nothing raises out of it."""
    global _listener
    if _listener is not None or not recording():
        return False
    path = directory / fr_request_name(rank)
    try:
        try:
            os.mkfifo(path, 0o600)
        except FileExistsError:
            pass
        # O_RDWR: the open never blocks and reads never see end-of-file when a writer closes; rlsup's
        # non-blocking open for writing succeeds only while this end is open (ENXIO otherwise).
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        os.set_blocking(fd, True)
    except OSError:
        return False
    stop = threading.Event()
    thread = threading.Thread(target=_serve, args=(fd, stop, directory / fr_dump_name(rank)),
                              name="rlsup-flight-recorder", daemon=True)
    listener = _Listener(thread, fd, stop)
    try:
        listener.thread.start()
    except RuntimeError:  # no thread to be had (the process is at its limit): no listener, the job goes on
        os.close(fd)
        return False
    _listener = listener
    return True


def stop_listener(timeout_s: float = 10.0) -> bool:
    """End this process's listener (for tests that start one in process): the thread is woken through its own
    FIFO, closes it and exits. True where none is left running."""
    global _listener
    listener, _listener = _listener, None
    if listener is None:
        return True
    listener.stop.set()
    try:
        os.write(listener.fd, b"q")
    except OSError:
        pass
    listener.thread.join(timeout_s)
    return not listener.thread.is_alive()


def _serve(fd: int, stop: threading.Event, out: Path) -> None:
    """One dump per request byte, until :func:`stop_listener` (or the process) ends it."""
    try:
        while not stop.is_set():
            try:
                data = os.read(fd, 64)
            except OSError:
                return
            if not data or stop.is_set():
                return
            try:
                write_dump(out)
            except Exception:  # noqa: BLE001 - never a traceback in the job's output; the next request retries
                continue
    finally:
        os.close(fd)


def write_dump(out: Path) -> None:
    """Write this rank's Flight Recorder dump to ``out`` (tmp + rename: rlsup never reads half of it);
    a rank that cannot dump writes why, so rlsup does not wait for it."""
    try:
        body = json.dumps(dump())
    except Exception as e:  # noqa: BLE001 - any failure becomes the answer rlsup reads
        body = json.dumps({"error": f"{type(e).__name__}: {e}"})
    tmp = out.with_name(out.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(body)
        os.replace(tmp, out)
    except OSError as e:  # the answer rlsup reads says why, written in place (small: one write); else none
        try:
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, json.dumps({"error": f"dump not written: {type(e).__name__}: {e}"}).encode())
            finally:
                os.close(fd)
        except OSError:
            pass


def dump() -> dict[str, Any]:
    """torch's dump of this rank (every entry), with this rank's groups and global rank added: the ring gloo
    records into and, on CUDA builds, NCCL's own ring, merged (a job may have groups of both)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return {"error": "torch.distributed is not initialised in this process"}
    rings = []
    try:  # a build may lack either ring's dump: each is imported on its own
        from torch._C._distributed_c10d import _dump_fr_trace_json
    except ImportError:
        pass
    else:
        rings.append(json.loads(_dump_fr_trace_json()))
    try:  # CUDA builds keep NCCL's collectives in a ring of their own
        from torch._C._distributed_c10d import _dump_nccl_trace_json
    except ImportError:
        pass
    else:
        rings.append(json.loads(_dump_nccl_trace_json()))
    if not rings:
        return {"error": "this torch has no Flight Recorder dump"}
    data = merge(*rings)
    data["rlsup_rank"] = dist.get_rank()
    try:
        data["rlsup_pg_config"] = process_groups()
    except Exception as e:  # noqa: BLE001 - the entries are still worth having; rlsup says what is missing
        data["rlsup_pg_config"] = {}
        data["rlsup_pg_config_error"] = f"{type(e).__name__}: {e}"
    return data


def merge(*rings: dict[str, Any]) -> dict[str, Any]:
    """One dump from several rings (gloo's and NCCL's): the first ring's fields, every ring's entries in the
    order they were created (each entry names its own process group), and every ring's groups."""
    with_entries = [r for r in rings if r.get("entries")]
    if len(with_entries) <= 1:
        return dict(with_entries[0] if with_entries else rings[0])
    data = dict(with_entries[0])
    entries = [e for r in with_entries for e in r["entries"]]
    data["entries"] = sorted(entries, key=lambda e: e.get("time_created_ns", 0) if isinstance(e, dict) else 0)
    data["pg_config"] = {k: v for r in reversed(with_entries) for k, v in dict(r.get("pg_config") or {}).items()}
    data["pg_status"] = {k: v for r in reversed(with_entries) for k, v in dict(r.get("pg_status") or {}).items()}
    return data


def process_groups() -> dict[str, dict[str, str]]:
    """``{pg name: {name, desc, ranks}}`` for every group this rank belongs to, in FR's ``pg_config`` form."""
    from torch.distributed import distributed_c10d as c10d

    out: dict[str, dict[str, str]] = {}
    for info in c10d._get_all_pg_configs():
        name = str(info["pg_name"])
        ranks = info["ranks"] or list(range(int(info["group_size"])))  # [] means every rank
        out[name] = {"name": name, "desc": str(info["pg_desc"]), "ranks": str(sorted(int(r) for r in ranks))}
    return out
