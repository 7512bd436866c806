"""Probe NVRx's async checkpoint machinery (nvidia_resiliency_ext.checkpointing.async_ckpt) on CPU, no CUDA.

    .venv/bin/python benchmarks/probe_nvrx_async.py [--mb 64]

Each probe tries one way of saving CPU tensors without blocking the training loop and prints whether it
worked and, if not, the first error. The working path is timed against a plain synchronous
``torch.save``: how long the trainer is blocked, and how long until the file is complete.
Findings are recorded in docs/nvrx.md. Runs in one process with a world-size-1 gloo group (NVRx's
callers read ``torch.distributed.get_rank()``); a probe that fails leaves nothing running.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

RESULTS: list[tuple[str, str, str]] = []


def first_error(e: BaseException) -> str:
    """The exception and the innermost NVRx/torch frame that raised it."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "site-packages" in f.filename]
    where = ""
    if frames:
        f = frames[-1]
        where = f" at {f.filename.split('site-packages/')[-1]}:{f.lineno} ({f.line})"
    nvrx = [f for f in traceback.extract_tb(e.__traceback__) if "nvidia_resiliency_ext" in f.filename]
    if nvrx and nvrx[-1] is not (frames[-1] if frames else None):
        f = nvrx[-1]
        where += f"; called from {f.filename.split('site-packages/')[-1]}:{f.lineno} ({f.line})"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{where}"


def probe(name: str, fn: Callable[[], str]) -> bool:
    t0 = time.perf_counter()
    try:
        detail = fn()
        verdict, ok = "works", True
    except Unsafe as e:
        detail, verdict, ok = str(e), "UNSAFE", False
    except BaseException as e:  # a probe reports every failure, including AssertionError
        detail, verdict, ok = first_error(e), "FAILS", False
    RESULTS.append((name, verdict, detail))
    print(f"  [{time.perf_counter() - t0:5.1f}s] {verdict:<5} {name}", flush=True)
    return ok


def make_state(mb: int) -> dict:
    n = mb * 2**18  # float32
    return {"weight": torch.arange(n, dtype=torch.float32), "bias": torch.ones(1024), "step": 7}


def clone_state(state: dict) -> dict:
    """The CPU stand-in for NVRx's GPU->host "preload": a private copy the trainer may not mutate."""
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def save_at(path: str, state: dict) -> None:
    """torch.save with the state second: NVRx's worker puts ``preload_fn()``'s result into
    ``async_fn_args[1]`` ("the 2nd arg is state dict"), so ``torch.save(state, path)`` itself cannot
    take a preload_fn (its path would be replaced by the state)."""
    torch.save(state, path)


class Unsafe(Exception):
    """The probe ran, but the result is not a consistent checkpoint."""


def finalize(q, no_dist: bool = True, timeout: float = 60.0) -> list[int]:
    """``maybe_finalize_async_calls`` polled with a deadline: NVRx's own ``blocking=True`` loops forever
    (sleep 0.1 s, no liveness check) when the persistent worker process has died."""
    deadline = time.monotonic() + timeout
    done: list[int] = []
    while q.get_num_unfinalized_calls():
        done += q.maybe_finalize_async_calls(blocking=False, no_dist=no_dist)
        caller = q.persistent_caller
        if q.get_num_unfinalized_calls() and caller is not None and caller.process is not None \
                and not caller.process.is_alive() and caller.comp_q.empty():
            raise RuntimeError(f"NVRx persistent checkpoint worker died (exit code {caller.process.exitcode}); "
                               "blocking=True would wait forever")
        if time.monotonic() > deadline:
            raise TimeoutError(f"async save not finalized within {timeout}s")
        time.sleep(0.02)
    return done


def close(q) -> None:
    """Stop the persistent worker without NVRx's close(), which finalizes with no_dist=False (CUDA)."""
    caller = q.persistent_caller
    if caller is not None and caller.process is not None:
        if caller.process.is_alive():
            caller.queue.put("DONE")
            caller.process.join(10)
        if caller.process.is_alive():
            caller.process.kill()
            caller.process.join()
        caller.process = None


# ------------------------------------------------------------------------------------------- probes


def p_torch_async_checkpoint(tmp: Path, mb: int, persistent: bool) -> str:
    from nvidia_resiliency_ext.checkpointing.async_ckpt.torch_ckpt import TorchAsyncCheckpoint

    ckpt = TorchAsyncCheckpoint(persistent_queue=persistent)
    try:
        ckpt.async_save(make_state(mb), str(tmp / f"tac_{persistent}.pt"))
        finalize(ckpt._async_calls_queue)
    finally:
        close(ckpt._async_calls_queue)
    return "saved"


def p_queue_without_process_group(tmp: Path) -> str:
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest

    q = AsyncCallsQueue(persistent=True)
    try:
        q.schedule_async_request(AsyncRequest(torch.save, ({"x": torch.ones(4)}, str(tmp / "nopg.pt")), []))
        finalize(q)
    finally:
        close(q)
    return "saved"


def p_queue(tmp: Path, mb: int, persistent: bool, no_dist: bool) -> str:
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest

    q = AsyncCallsQueue(persistent=persistent)
    path = tmp / f"queue_{persistent}_{no_dist}.pt"
    finalized: list[int] = []
    req = AsyncRequest(torch.save, (clone_state(make_state(mb)), str(path)), [lambda: finalized.append(1)])
    try:
        q.schedule_async_request(req)
        if persistent:
            finalize(q, no_dist=no_dist)
        else:
            q.maybe_finalize_async_calls(blocking=True, no_dist=no_dist)
    finally:
        close(q)
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["weight"], make_state(mb)["weight"]) and finalized == [1]
    return "saved and finalized; content verified"


def p_live_tensor_mutation(tmp: Path, mb: int, preload: bool) -> str:
    """Schedule a save of the live state, then change it in place as the next optimizer step would."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest

    q = AsyncCallsQueue(persistent=True)
    state = make_state(mb)
    path = tmp / f"live_{preload}.pt"
    if preload:  # preload_fn runs in the worker while the trainer waits: the copy is the snapshot
        req = AsyncRequest(save_at, (str(path), None), [], preload_fn=partial(clone_state, state))
    else:
        req = AsyncRequest(torch.save, (state, str(path)), [])
    try:
        q.schedule_async_request(req)
        time.sleep(0.2)  # the queue's feeder thread has pickled the request by now
        shared = state["weight"].is_shared()
        state["weight"].fill_(-1.0)  # the "next step" mutates the tensors in place
        finalize(q)
    finally:
        close(q)
    saved = torch.load(path, weights_only=True)["weight"]
    snapshot_ok = torch.equal(saved, make_state(mb)["weight"])
    mutated = bool((saved == -1.0).any())
    if snapshot_ok:
        desc = "checkpoint = state at schedule time (consistent)"
    elif mutated:
        desc = (f"checkpoint holds values written AFTER the save was scheduled ({int((saved == -1).sum())}"
                f"/{saved.numel()} elements)")
    else:
        desc = "checkpoint matches neither state"
    if shared:
        desc += "; sending the request moved the trainer's own tensors into shared memory (/dev/shm)"
    if not snapshot_ok:
        raise Unsafe(desc)
    return desc


def p_filesystem_writer(tmp: Path, mb: int, keep_nvrx_preload: bool) -> str:
    """torch.distributed.checkpoint format through FileSystemWriterAsync + save_state_dict_async_plan."""
    import torch.distributed.checkpoint as dcp
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
    from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
        save_state_dict_async_finalize, save_state_dict_async_plan)

    ckpt_dir = tmp / f"dcp_{keep_nvrx_preload}"
    ckpt_dir.mkdir()
    state = make_state(mb)
    state.pop("step")
    writer = FileSystemWriterAsync(str(ckpt_dir), thread_count=2)
    writer, metadata, dist_wrapper = save_state_dict_async_plan(state, writer)
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    if not keep_nvrx_preload:
        # NVRx hard-codes preload_tensors(..., non_blocking=True), which calls torch.cuda.synchronize().
        preload_fn = partial(FileSystemWriterAsync.preload_tensors, writer.write_buckets, False)
    finalize_dcp = partial(save_state_dict_async_finalize, writer, metadata, dist_wrapper)
    q = AsyncCallsQueue(persistent=True)
    try:
        q.schedule_async_request(AsyncRequest(save_fn, save_args, [finalize_dcp], preload_fn=preload_fn))
        finalize(q)
    finally:
        close(q)
    loaded = {"weight": torch.zeros_like(state["weight"]), "bias": torch.zeros(1024)}
    dcp.load(loaded, checkpoint_id=str(ckpt_dir))
    assert torch.equal(loaded["weight"], state["weight"])
    return f"dcp checkpoint written ({len(list(ckpt_dir.iterdir()))} files) and loaded back with dcp.load"


def p_filesystem_writer_nvrx_preload_in_child(timeout: float = 20.0) -> str:
    """NVRx's own preload_fn, in a child process: if the worker dies in preload_fn, the trainer's
    ``schedule_async_request`` waits on ``preload_q.join()`` forever, so only a child can be timed out."""
    import signal
    import subprocess

    # Own session, so that on timeout the whole group goes: the child, its dead worker's siblings
    # (the spawned Manager that serves FileSystemWriterAsync's results queue) and its resource tracker.
    child = subprocess.Popen([sys.executable, __file__, "--child-dcp-nvrx-preload"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        stdout, out = child.communicate()
        cause = [line.strip() for line in out.splitlines() if "Error" in line][-1:] or ["(no error printed)"]
        raise RuntimeError(f"HANGS: schedule_async_request still blocked after {timeout:.0f}s; the worker died in "
                           f"preload_fn with {cause[0]} (torch.cuda.synchronize() in "
                           "FileSystemWriterAsync.preload_tensors) and the trainer waits on preload_q.join()") from None
    if child.returncode != 0:
        raise RuntimeError(f"child exited {child.returncode}: {stderr.strip().splitlines()[-1:]}")
    return stdout.strip().splitlines()[-1]


def p_local_checkpoint_manager(tmp: Path) -> str:
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager

    mgr = LocalCheckpointManager(str(tmp / "local"))
    mgr.save(BasicTensorAwareStateDict({"w": torch.ones(8)}), 1, is_async=False)
    return "saved"


# ------------------------------------------------------------------------------------------- timing


def timing(tmp: Path, mb: int, repeats: int = 3) -> list[str]:
    """How long the trainer is blocked: the working async path vs a synchronous torch.save (page cache,
    no fsync in either), and the in-process copy alone."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest

    state = make_state(mb)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    sync, copy = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        torch.save(state, tmp / f"sync_{i}.pt")
        sync.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        clone_state(state)
        copy.append(time.perf_counter() - t0)
    q = AsyncCallsQueue(persistent=True)
    blocked, total = [], []
    try:
        t0 = time.perf_counter()
        q.schedule_async_request(AsyncRequest(save_at, (str(tmp / "warm.pt"), None), [],
                                              preload_fn=partial(clone_state, {"x": torch.ones(1)})))
        finalize(q)
        warm = time.perf_counter() - t0
        for i in range(repeats + 1):  # the first moves the state into shared memory: not counted
            t0 = time.perf_counter()
            q.schedule_async_request(AsyncRequest(save_at, (str(tmp / f"async_{i}.pt"), None), [],
                                                  preload_fn=partial(clone_state, state)))
            t1 = time.perf_counter()
            finalize(q)
            if i:
                blocked.append(t1 - t0)
                total.append(time.perf_counter() - t0)
    finally:
        close(q)
    return [
        f"state: {mb} MiB of float32 on CPU, median of {repeats}; page cache, no fsync",
        f"  synchronous torch.save                  : trainer blocked {med(sync) * 1e3:7.1f} ms",
        f"  clone of the state alone                : {med(copy) * 1e3:7.1f} ms",
        f"  AsyncCallsQueue(persistent) + clone     : trainer blocked {med(blocked) * 1e3:7.1f} ms, "
        f"saved and finalized after {med(total) * 1e3:7.1f} ms",
        f"  first request (spawns the worker, which imports torch): {warm * 1e3:.0f} ms",
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=64, help="Size of the probe state in MiB.")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child-dcp-nvrx-preload", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_dcp_nvrx_preload:
        with tempfile.TemporaryDirectory(prefix="nvrx_probe_child_") as d:
            dist.init_process_group("gloo", init_method=f"file://{d}/pg", rank=0, world_size=1)
            print(p_filesystem_writer(Path(d), 4, keep_nvrx_preload=True), flush=True)
            dist.destroy_process_group()
        return 0
    try:
        import nvidia_resiliency_ext  # noqa: F401
        from importlib.metadata import version
        nvrx_version = version("nvidia-resiliency-ext")
    except ImportError:
        print("nvidia-resiliency-ext is not installed: pip install -e '.[nvrx]' (see docs/nvrx.md)")
        return 1
    print(f"torch {torch.__version__}, cuda available: {torch.cuda.is_available()}, "
          f"nvidia-resiliency-ext {nvrx_version}, python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory(prefix="nvrx_probe_") as d:
        tmp = Path(d)
        probe("AsyncCallsQueue without a torch.distributed process group",
              lambda: p_queue_without_process_group(tmp))
        dist.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=0, world_size=1)
        try:
            probe("TorchAsyncCheckpoint(persistent_queue=True).async_save",
                  lambda: p_torch_async_checkpoint(tmp, args.mb, True))
            probe("TorchAsyncCheckpoint(persistent_queue=False).async_save",
                  lambda: p_torch_async_checkpoint(tmp, args.mb, False))
            probe("AsyncCallsQueue(persistent=False) (fork per save)",
                  lambda: p_queue(tmp, args.mb, persistent=False, no_dist=True))
            probe("AsyncCallsQueue(persistent=True), finalize no_dist=False",
                  lambda: p_queue(tmp, args.mb, persistent=True, no_dist=False))
            probe("AsyncCallsQueue(persistent=True), finalize no_dist=True",
                  lambda: p_queue(tmp, args.mb, persistent=True, no_dist=True))
            probe("persistent queue, live CPU tensors, mutated after scheduling",
                  lambda: p_live_tensor_mutation(tmp, args.mb, preload=False))
            probe("persistent queue, preload_fn=clone, mutated after scheduling",
                  lambda: p_live_tensor_mutation(tmp, args.mb, preload=True))
            probe("FileSystemWriterAsync (dcp format), preload non_blocking=False",
                  lambda: p_filesystem_writer(tmp, args.mb, keep_nvrx_preload=False))
            probe("LocalCheckpointManager.save (CPU tensors)", lambda: p_local_checkpoint_manager(tmp))
            probe("FileSystemWriterAsync (dcp format), NVRx's own preload_fn",
                  p_filesystem_writer_nvrx_preload_in_child)
            width = max(len(r[0]) for r in RESULTS)
            print()
            for name, verdict, detail in RESULTS:
                print(f"{name:<{width}}  {verdict:<5}  {detail}")
            print()
            for line in timing(tmp, args.mb, args.repeats):
                print(line)
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
