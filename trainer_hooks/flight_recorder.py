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
from pathlib import Path
from typing import Any

from rlsup_format.heartbeat_record import fr_dump_name, fr_request_name

BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_started = False


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
    per process, only where the Flight Recorder records). False where none was started."""
    global _started
    if _started or not recording():
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
    _started = True
    threading.Thread(target=_serve, args=(fd, directory / fr_dump_name(rank)), name="rlsup-flight-recorder",
                     daemon=True).start()
    return True


def _serve(fd: int, out: Path) -> None:
    """One dump per request byte, for the life of the process."""
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if not data:
            return
        write_dump(out)


def write_dump(out: Path) -> None:
    """Write this rank's Flight Recorder dump to ``out`` (tmp + rename: rlsup never reads half of it);
    a rank that cannot dump writes why, so rlsup does not wait for it."""
    try:
        body = json.dumps(dump())
    except Exception as e:  # noqa: BLE001 - any failure becomes the answer rlsup reads
        body = json.dumps({"error": f"{type(e).__name__}: {e}"})
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(body)
    os.replace(tmp, out)


def dump() -> dict[str, Any]:
    """torch's dump of this rank (every entry), with this rank's groups and global rank added: NCCL's
    ring where it holds entries (a GPU job), else the one gloo records into."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return {"error": "torch.distributed is not initialised in this process"}
    from torch._C._distributed_c10d import _dump_fr_trace_json

    data = json.loads(_dump_fr_trace_json())
    try:  # CUDA builds keep NCCL's collectives in a ring of their own
        from torch._C._distributed_c10d import _dump_nccl_trace_json
    except ImportError:
        pass
    else:
        nccl = json.loads(_dump_nccl_trace_json())
        if nccl.get("entries") or not data.get("entries"):
            data = nccl
    data["rlsup_rank"] = dist.get_rank()
    data["rlsup_pg_config"] = process_groups()
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
