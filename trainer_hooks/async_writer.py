"""Asynchronous checkpoint saves: ``CheckpointManager(async_save=True)``.

``save()`` blocks the training loop only while the state is copied off the training tensors; a
separate writer *process* then does everything that costs time (serialisation, fsync, xxh3 hashing,
renames, the manifest, retention) by running the very protocol of a synchronous save,
:func:`trainer_hooks.step_writer.write_step`, so a step is valid only once all of it happened.
The saver is handed plain data (the step, the payload, a :class:`~trainer_hooks.step_writer.RankIdentity`,
a :class:`~trainer_hooks.step_writer.StepTarget`); it never sees the manager, and this module never
imports :mod:`trainer_hooks.checkpoint`.

Design, and why:

* **The snapshot** goes into one anonymous shared-memory buffer per save (``memfd_create``, mapped by
  both processes): every tensor is ``copy_``-ed into its own 64-byte-aligned slice, everything else
  (ints, lists, NumPy RNG states, the sampler's dict) is pickled with the tensors replaced by small
  references, which is also its deep copy. The trainer may change its tensors in place the moment
  ``save()`` returns. A ``memfd`` has no name, so nothing can leak in ``/dev/shm`` when a process is
  SIGKILLed (the kernel frees it with the last mapping), and it is not bounded by the size of
  ``/dev/shm`` (64 MB in a default Docker container). When CUDA is available the buffer is pinned
  (``cudaHostRegister``), so GPU->host copies are DMA. Buffers are kept for reuse (no page faults, no
  re-pinning on the next save) unless ``keep_buffers=False``.
* **The writer** is one long-lived process per manager, started when the manager is built (its start-up,
  1-2 s and much more on loaded cores, then overlaps the trainer's restore and first step; started on the
  first save, it made the second save of every attempt wait for it), with ``subprocess`` (``python -m trainer_hooks.async_writer``: a fresh interpreter, like the ``spawn``
  start method, but it does not re-import the training script's ``__main__``, which hangs or re-runs
  scripts without an ``if __name__ == "__main__"`` guard). It is fed through a Unix socket; the
  buffer's file descriptor travels with each request (``SCM_RIGHTS``). A process and not a thread:
  serialising and hashing a large state holds the GIL for long stretches, and a crash or OOM kill of
  the writer must not take the trainer with it. One process per save would pay a torch import
  (1-2 s) per save; a forked one would copy a CUDA/threaded trainer.
* **Failure semantics.** The writer dies with the trainer (``PR_SET_PDEATHSIG``), ignores the
  signals rlsup relays to the job (SIGTERM, SIGINT, the preemption signal, SIGUSR2), and a killed
  writer leaves a staging directory and no manifest: the step is invalid and the previous valid ones
  are untouched (they are never rewritten). A background save that failed (an exception in the
  writer, or the writer died) raises :class:`AsyncSaveError` from the next ``save()`` or ``wait()``,
  as the synchronous save would have raised; the next save starts a new writer.
* **Flushing.** ``wait()`` blocks until nothing is in flight; an ``atexit`` hook does the same at
  interpreter exit; a ``save()`` called while :func:`trainer_hooks.should_stop` is true (preemption)
  waits for its own write before returning, so the trainer may exit right after it.
* **Into the memory tier** the writer builds the step in a spare file it allocated and mapped after
  the previous save, instead of ``torch.save`` writing into fresh tmpfs pages (the cost of a save
  there): :mod:`trainer_hooks.direct_save`. Same file, same protocol; ``CheckpointManager(...,
  direct_save=False)`` turns it off.
* **Heartbeat.** Only the blocking part (waiting for a slot, the copy) is inside ``section("save")``;
  the rank heartbeats normally while the writer works. The writer never touches heartbeat files.

Only the ``torch`` backend (per-rank files, no collectives) is written asynchronously.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import logging
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer_hooks import writer_guard  # first: run as the writer, it guards the process before torch's import

import torch

from rlsup_format import job_env
from rlsup_format.names import step_dir_name
from trainer_hooks.backends import get_backend
from trainer_hooks.direct_save import SpareKeeper, rebuild_payload
from trainer_hooks.snapshot import SnapshotBuffer, snapshot
from trainer_hooks.step_writer import PayloadSource, RankIdentity, StepTarget, write_step

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<Q")
#: Seconds to wait for the writer to exit after it was asked to.
STOP_TIMEOUT_S = 30.0


class AsyncSaveError(RuntimeError):
    """A background save failed (an exception in the writer, or the writer process died)."""


# ------------------------------------------------------------------------------------ framing


def _send(sock: socket.socket, obj: Any, fds: list[int] | None = None) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(data))
    if fds:
        socket.send_fds(sock, [header], fds)
    else:
        sock.sendall(header)
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int, first: bytes = b"") -> bytes | None:
    chunks, got = [first], len(first)
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> tuple[Any, list[int]] | None:
    """One message and the descriptors sent with it; None on EOF (the other side is gone)."""
    data, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 4)
    if not data:
        for fd in fds:
            os.close(fd)
        return None
    header = _recv_exact(sock, _HEADER.size, data)
    body = None if header is None else _recv_exact(sock, _HEADER.unpack(header)[0])
    if body is None:
        for fd in fds:
            os.close(fd)
        return None
    return pickle.loads(body), list(fds)


# ------------------------------------------------------------------------- trainer side: snapshot


@dataclass
class _Job:
    job_id: int
    step: int
    step_dir: Path
    buffer: SnapshotBuffer
    started: float
    done: bool = False
    error: str | None = None
    result: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- trainer side: saver

_live_savers: "weakref.WeakSet[AsyncSaver]" = weakref.WeakSet()


def _flush_all_at_exit() -> None:
    for saver in list(_live_savers):
        try:
            saver.close()
        except Exception as e:  # noqa: BLE001 - never raise from atexit
            log.error("async checkpoint flush at exit failed: %s", e)
            print(f"rlsup: async checkpoint flush at exit failed: {e}", file=sys.stderr)


atexit.register(_flush_all_at_exit)


def _forget_writers_in_child() -> None:
    """A process forked from a trainer (a DataLoader worker, a user's ``os.fork``) does not own the trainer's
    writers: it drops its copies of their sockets unsent, so its exit never stops them, and a save it made
    would start a writer of its own. No lock taken: another thread may have held one at the fork."""
    for saver in list(_live_savers):
        saver.forget_after_fork()


os.register_at_fork(after_in_child=_forget_writers_in_child)


class AsyncSaver:
    """The trainer side: snapshots, hands requests to the writer process, tracks what is in flight."""

    def __init__(self, backend_name: str = "torch", max_in_flight: int = 1, when_busy: str = "wait",
                 keep_buffers: bool = True, direct_save: bool = True) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        if when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy must be 'wait' or 'skip', got {when_busy!r}")
        self.backend_name = backend_name
        self.max_in_flight = max_in_flight
        self.when_busy = when_busy
        self.keep_buffers = keep_buffers
        self.direct_save = direct_save  # into the memory tier: build files in a spare (trainer_hooks.direct_save)
        self.inflight: list[_Job] = []
        self.free: list[SnapshotBuffer] = []
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.writer_used = False  # whether the current writer was sent a request (one never used is killed)
        self.failed: list[_Job] = []
        self.completed: list[_Job] = []  # the last few, for tests and logs
        self._next_id = 0
        self._lock = threading.RLock()
        _live_savers.add(self)
        self._start_writer()  # its interpreter and torch import overlap the restore, not the first save

    # ------------------------------------------------------------------ writer process

    @property
    def writer_pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def _start_writer(self) -> None:
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        child_fd = child_sock.fileno()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        main_thread = threading.current_thread() is threading.main_thread()
        cmd = [sys.executable, "-m", "trainer_hooks.async_writer", "--fd", str(child_fd),
               "--parent", str(os.getpid())]
        if main_thread:  # PDEATHSIG follows the creating *thread*: only safe from the main thread
            cmd.append("--die-with-parent")
        try:
            with writer_guard.blocked_while_spawning():  # until the writer's guard ignores them
                self.proc = subprocess.Popen(cmd, pass_fds=[child_fd], env=env, stdin=subprocess.DEVNULL,
                                             close_fds=True)
        finally:
            child_sock.close()
        self.sock, self.writer_used = parent_sock, False
        log.info("async checkpoint writer started (pid %d)", self.proc.pid)

    def _writer_gone(self, why: str) -> None:
        """The writer died: every request in flight failed."""
        code = None
        if self.proc is not None:
            try:
                code = self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait()
        desc = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        for job in self.inflight:
            job.done, job.error = True, f"the checkpoint writer process died ({desc}) {why}"
            self._finish(job)
        self.inflight = []
        if self.sock is not None:
            self.sock.close()
        self.sock, self.proc = None, None

    # ------------------------------------------------------------------ bookkeeping

    def _finish(self, job: _Job) -> None:
        if job.error:
            log.error("async save of step %d failed: %s", job.step, job.error)
            self.failed.append(job)
        else:
            log.info("async save of step %d complete after %.2fs", job.step, time.monotonic() - job.started)
        self.completed = (self.completed + [job])[-8:]
        if self.keep_buffers and len(self.free) < self.max_in_flight:
            self.free.append(job.buffer)
        else:
            job.buffer.close()

    def _collect(self, timeout: float | None) -> bool:
        """Read one reply (waiting up to ``timeout``; None: forever). False when none came."""
        if not self.inflight or self.sock is None:
            return False
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return False
        try:
            msg = _recv(self.sock)
        except OSError as e:
            msg = None
            why = f"({e})"
        else:
            why = "while writing"
        if msg is None:
            self._writer_gone(why)
            return True
        (kind, job_id, ok, info), fds = msg
        for fd in fds:
            os.close(fd)
        job = next(j for j in self.inflight if j.job_id == job_id)
        self.inflight.remove(job)
        job.done, job.result = True, info
        if not ok:
            job.error = info.get("error", "unknown error")
        self._finish(job)
        return True

    def poll(self) -> None:
        """Collect finished saves without blocking."""
        with self._lock:
            while self._collect(0):
                pass

    def raise_failures(self) -> None:
        if self.failed:
            failed, self.failed = self.failed, []
            msgs = "; ".join(f"step {j.step}: {j.error}" for j in failed)
            raise AsyncSaveError(f"asynchronous checkpoint save failed: {msgs}")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is in flight (True) or ``timeout`` passed (False); raise failures."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self.inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._collect(left)
            done = not self.inflight
        self.raise_failures()
        return done

    # ------------------------------------------------------------------ save

    def save(self, target: StepTarget, step: int, payload: PayloadSource, who: RankIdentity,
             preempted: bool) -> Path | None:
        """The blocking part of a save: wait for a slot (or skip), snapshot ``payload`` (or what the
        callable makes, once a slot is free), hand it to the writer. ``preempted``: the job is about to
        exit, so never skip and wait for this write before returning."""
        with self._lock:
            if not self._free_slot(step, preempted):
                return None
            data = payload() if callable(payload) else payload
            skeleton, table, buf = snapshot(data, self.free)
            del data
            if self.proc is None or self.proc.poll() is not None or self.sock is None:
                if self.sock is not None:
                    self._writer_gone("before the request was sent")
                self._start_writer()
            self._next_id += 1
            step_dir = Path(target.directory) / step_dir_name(step)
            job = _Job(self._next_id, step, step_dir, buf, time.monotonic())
            request = {"target": target, "backend": self.backend_name, "who": who, "step": step,
                       "skeleton": skeleton, "table": table, "size": buf.size, "keep": self.keep_buffers,
                       "direct": target.memory and self.direct_save}
            self.inflight.append(job)
            try:
                assert self.sock is not None
                self.writer_used = True
                _send(self.sock, ("save", job.job_id, request), [buf.fd])
            except OSError as e:
                self._writer_gone(f"(request not delivered: {e})")
        if preempted:
            self.wait()  # the job is about to exit: this save must be on disk first
        return step_dir

    def _free_slot(self, step: int, preempted: bool) -> bool:
        """Collect finished saves and raise their failures; then a slot is free (True), or the save
        is skipped (False, ``when_busy="skip"`` and not preempted)."""
        while self._collect(0):
            pass
        self.raise_failures()
        if len(self.inflight) < self.max_in_flight:
            return True
        if self.when_busy == "skip" and not preempted:
            log.warning("step %d not saved: %d save(s) still in flight (when_busy='skip')", step, len(self.inflight))
            return False
        while len(self.inflight) >= self.max_in_flight:
            self._collect(None)
        self.raise_failures()
        return True

    def forget_after_fork(self) -> None:
        """In a forked child: the writer and what is in flight are the parent's (see the module's fork hook)."""
        if self.sock is not None:
            self.sock.close()  # this process's copy only: nothing is sent
        self.sock, self.proc, self.inflight, self.free = None, None, [], []
        self.failed, self.completed, self.writer_used = [], [], False
        self._lock = threading.RLock()

    def close(self) -> None:
        """Flush, then stop the writer and free the buffers."""
        try:
            self.wait()
        finally:
            with self._lock:
                if self.proc is not None and not self.writer_used:
                    self.proc.kill()  # it wrote nothing, and may still be importing torch: no 30 s wait at a stop
                    if self.sock is not None:
                        self.sock.close()  # nothing to send to a dying peer
                        self.sock = None
                if self.sock is not None:
                    try:
                        _send(self.sock, ("stop", 0, {}))
                    except OSError:
                        pass
                    self.sock.close()
                    self.sock = None
                if self.proc is not None:
                    try:
                        self.proc.wait(timeout=STOP_TIMEOUT_S)
                    except subprocess.TimeoutExpired:
                        self.proc.kill()
                        self.proc.wait()
                    self.proc = None
                for b in self.free:
                    b.close()
                self.free = []


# ------------------------------------------------------------------------------ writer process


def _write(request: dict, fd: int, keeper: SpareKeeper) -> tuple[str, bool]:
    """Run the step-writing protocol (:func:`trainer_hooks.step_writer.write_step`) on the snapshot:
    into a ready spare file when the save may be direct (:mod:`trainer_hooks.direct_save`), else with
    ``torch.save``; returns the step directory and whether it was direct. Then a spare for the next
    save, once the reply is sent (:meth:`SpareKeeper.after`)."""
    mm = keeper.snapshot_map(fd, request["size"], request.get("keep", False))
    view = memoryview(mm)
    payload = rebuild_payload(request["skeleton"], request["table"], view)
    base = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
    direct = keeper.backend_for(request, payload, view, base)
    try:
        step_dir = write_step(request["target"], request["step"], payload, request["who"],
                              direct or get_backend(request["backend"]))
    finally:
        keeper.settle(direct)
    was_direct = direct is not None
    del payload, direct
    if not keeper.kept(mm):
        try:
            mm.close()
        except BufferError:
            pass
    return str(step_dir), was_direct


def _skip_zip_crc32() -> None:
    """This process only writes steps, and every byte of a step is checked by its manifest's xxh3: the
    zip CRC32 that ``torch.save`` computes on top costs a third of a large save into memory (the files
    load the same; torch >= 2.6 has the switch, older ones keep computing it)."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        return
    if hasattr(config, "save") and hasattr(config.save, "compute_crc32"):
        config.save.compute_crc32 = False


def writer_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="rlsup asynchronous checkpoint writer (started by CheckpointManager)")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--die-with-parent", action="store_true")
    args = ap.parse_args(argv)
    writer_guard.guard(args.parent, args.die_with_parent)  # again, for a caller that did not run the module
    os.environ.pop(job_env.HEARTBEAT_DIR, None)  # the rank's heartbeat file belongs to the trainer
    _skip_zip_crc32()
    logging.basicConfig(level=logging.WARNING, format="rlsup-writer: %(message)s")
    gc.collect()
    gc.freeze()  # torch's objects live as long as the writer: no collection walks them again, nor its exit (0.4 s)
    keeper = SpareKeeper()
    try:
        return _serve(socket.socket(fileno=args.fd), keeper)
    finally:
        keeper.close()


def _serve(sock: socket.socket, keeper: SpareKeeper) -> int:
    """Answer the trainer's save requests until it says stop or goes away."""
    while True:
        try:
            msg = _recv(sock)
        except OSError:
            return 0
        if msg is None:
            return 0  # the trainer closed the socket (or died)
        (kind, job_id, request), fds = msg
        if kind == "stop":
            return 0
        t0 = time.monotonic()
        path = None
        try:
            path, direct = _write(request, fds[0], keeper)
            reply = ("done", job_id, True, {"path": path, "seconds": time.monotonic() - t0, "direct": direct})
        except BaseException as e:  # noqa: BLE001 - reported to the trainer, which raises it
            reply = ("done", job_id, False, {"error": f"{type(e).__name__}: {e}",
                                             "traceback": traceback.format_exc()})
        finally:
            for fd in fds:
                os.close(fd)
        try:
            _send(sock, reply)
        except OSError:
            return 0
        keeper.after(request, path)


if __name__ == "__main__":
    sys.exit(writer_main())
