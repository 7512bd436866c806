"""Calls into a directory that may stop answering, made from a thread that must not stop with them.

A read of a hung NFS, Lustre or FUSE mount blocks the calling thread in the kernel, and no signal gets it
back. The run loop polls heartbeats and detects hangs; it must never be that thread. So such a call runs in a
daemon thread given a deadline: past it the caller goes on with a default answer and the call is named once;
while it is still blocked, later calls are not started beside it (one stuck thread per store, not one per
poll). A thread blocked in the kernel cannot be joined or killed: it is left, and ends when the mount answers.

Such a thread holds more than itself: once rlsup exits, a thread of its own asleep in a FUSE (or Lustre) request
turns to state D and the kernel does not let the process end, nor its parent see the exit, until the mount
answers (SLURM's step never ends, the exit 77 that would requeue the job elsewhere never arrives). So what touches
the job's directories from a loop of rlsup's own runs in a child forked for the call (:func:`run_forked`;
``BoundedCalls(forked=True)``): the thread waits on a pipe, and a child stuck in the mount is left behind,
named by :func:`left_behind` when rlsup exits.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import struct
import sys
import threading
import time
from typing import Callable, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


class BoundedCalls:
    """Calls named ``what`` (e.g. "reading the checkpoint directory /ckpt"), each given ``deadline_s``."""

    def __init__(self, what: str, deadline_s: float, prepare: Callable[[], object] | None = None,
                 forked: bool = False, label: str = "") -> None:
        self.what, self.deadline_s = what, deadline_s
        self.label = label or what  # a forked call's child, as rlsup's exit line and record name it
        self.prepare = prepare  # run first in each call's thread (e.g. a private descriptor table)
        self.forked = forked  # each call in a child of its own (:func:`run_forked`): its value must pickle
        self.blocked_since: float | None = None  # a call that outlived its deadline and has not returned yet
        self.timeouts = 0
        self._moved_at: float | None = None  # the call being waited for: when its progress last changed
        self._lock = threading.Lock()

    def quiet_for(self) -> float:
        """Seconds since the call now waited for last moved (0 when none is): what another caller that waits for
        it (e.g. on a lock it holds) goes by."""
        moved = self._moved_at
        return 0.0 if moved is None else time.monotonic() - moved

    def call(self, fn: Callable[[], T], default: T, progress: Callable[[], object] | None = None,
             on_give_up: Callable[[], object] | None = None, owner: object = None,
             keep: tuple[str, ...] = ()) -> T:
        """``fn()``, or ``default`` when it has not returned within the deadline or an earlier call is still
        blocked. ``progress`` (e.g. bytes copied so far): while its value changes the deadline starts again, so
        a long copy that moves is never cut, one that stops moving is (a forked call without one: its child's
        read and write counts). ``on_give_up``: run when the caller goes on without the call (e.g. it tells a
        fetch that its result is no longer wanted). ``owner``/``keep`` (forked calls): as :func:`run_forked`,
        copied back only when the caller got the answer in time (a late answer changes nothing). Exceptions of
        ``fn`` reach the caller."""
        if self.blocked_since is not None:
            return default
        box: list[tuple[bool, object]] = []
        done = threading.Event()
        finished: list[bool] = []  # set under the lock: the caller names the call blocked only while it runs
        child: list[int] = []  # the forked call's pid, once forked
        if self.forked and progress is None:
            progress = lambda: _io_moved(child[0]) if child else None  # noqa: E731 - read off /proc, never the mount
        kept: dict[str, object] = {}

        def run() -> None:
            try:
                if self.prepare is not None:
                    self.prepare()
                if self.forked:
                    value, changed = _run_forked(fn, self.label, owner, keep, None, child.append)
                    kept.update(changed)
                    box.append((True, value))
                else:
                    box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                box.append((False, e))
            finally:
                with self._lock:
                    finished.append(True)
                    if self.blocked_since is not None:
                        log.info("%s answered after %.0fs", self.what, time.monotonic() - self.blocked_since)
                        self.blocked_since = None
                done.set()

        threading.Thread(target=run, daemon=True, name="rlsup-bounded-call").start()
        if not self._wait(done, progress):
            with self._lock:  # a call that returned meanwhile has nothing left to clear this
                if not finished:
                    self.blocked_since = time.monotonic()
            self.timeouts += 1
            if on_give_up is not None:
                on_give_up()
            log.warning("%s has not answered in %.0fs: the store is slow or not answering; going on without it",
                        self.what, self.deadline_s)
            return default
        ok, value = box[0]
        if not ok and isinstance(value, ChildLost):  # no answer, as past the deadline: the caller goes on without it
            log.warning("%s gave no answer (%s); going on without it", self.what, value)
            return default
        if not ok:
            raise value  # type: ignore[misc]
        for name, item in kept.items():
            setattr(owner, name, item)
        return value  # type: ignore[return-value]

    def _wait(self, done: threading.Event, progress: Callable[[], object] | None) -> bool:
        """Whether ``done`` came before ``deadline_s`` passed without ``progress`` changing."""
        self._moved_at = time.monotonic()
        try:
            if progress is None:
                return done.wait(self.deadline_s)
            seen = progress()
            while not done.wait(min(0.25, self.deadline_s)):
                now = progress()
                if now != seen:
                    seen, self._moved_at = now, time.monotonic()
                elif time.monotonic() - self._moved_at >= self.deadline_s:
                    return False
            return True
        finally:
            self._moved_at = None


# ------------------------------------------------------------------ calls in a forked child

#: Children forked by :func:`run_forked` that have not been reaped: pid -> (label, what it does now). Not part of
#: any job (:meth:`supervisor.processes.job.JobProcess._orphans` leaves them out); named at exit when left behind.
_children: dict[int, list[str]] = {}
_children_lock = threading.Lock()
_child_out: int | None = None  # in a forked child: the pipe to the parent (notes, log records, the result)
#: After its answer a child is waited for this long before the call returns (it is reaped later if not by then).
REAP_WAIT_S = 1.0


class ChildCallFailed(OSError):
    """The forked call raised (its type and message), or its child ended without an answer (:class:`ChildLost`)."""


class ChildLost(ChildCallFailed):
    """The forked call's child ended without an answer (killed, or it died before the call ran): the call gave no
    answer, as one past its deadline; :meth:`BoundedCalls.call` returns its default then."""


def note(text: str) -> None:
    """What a call running in a forked child does now (e.g. "copying step 4 rank 0"), for the parent's stall line
    and, at exit, its list of what it left; nothing outside a child."""
    if _child_out is not None:
        try:
            _send(_child_out, ("note", text))
        except OSError:
            pass  # a thread of the child's with a table of its own (supervisor.tiers.private_files): unsaid


def forked_child() -> bool:
    """Whether this process is a child of :func:`run_forked` (its changes to objects stay here)."""
    return _child_out is not None


def left_behind() -> list[dict]:
    """The forked children still there (alive, or dead and not reaped because their exit waits on a mount):
    ``pid``, ``label``, ``doing``, ``state`` (/proc's letter), ``wchan``."""
    out = []
    with _children_lock:
        for pid, (label, doing) in list(_children.items()):
            if _reaped(pid):
                _children.pop(pid, None)
                continue
            state, wchan = _proc_state(pid)
            out.append({"pid": pid, "label": label, "doing": doing, "state": state, "wchan": wchan})
    return out


def child_pids() -> set[int]:
    with _children_lock:
        return set(_children)


def run_forked(fn: Callable[[], T], label: str, owner: object = None, keep: tuple[str, ...] = (),
               on_note: Callable[[str], None] | None = None) -> T:
    """``fn()`` in a child forked from the calling thread; its value (pickled) returned, its exception raised as
    :class:`ChildCallFailed`. Why: a thread of rlsup's own blocked on a hung FUSE (or Lustre) mount sleeps in
    state D once the process exits, and the kernel does not let the process end, nor its parent (SLURM's step,
    the batch script) see the exit, until the mount answers; a child blocked there is simply left behind. The
    calling thread only reads a pipe (never in D): a daemon thread waiting here dies with the process.

    ``keep``: attributes of ``owner`` the call changes, copied back into the parent's ``owner`` once it
    returned (the child's memory is its own). ``on_note``: what the child says it is doing (:func:`note`).
    The child's log records are handled by the parent's loggers (one writer, the parent's line context).

    The child may take no lock another thread of the parent can hold at the fork (it would stay held there
    forever): a lock it needs is taken by the caller around this call (``PollLoop(hold=...)``), and the child,
    :func:`forked_child`, leaves it alone."""
    value, kept = _run_forked(fn, label, owner, keep, on_note)
    for name, item in kept.items():
        setattr(owner, name, item)
    return value


def _run_forked(fn: Callable[[], T], label: str, owner: object, keep: tuple[str, ...],
                on_note: Callable[[str], None] | None,
                on_fork: Callable[[int], object] | None = None) -> tuple[T, dict[str, object]]:
    """:func:`run_forked`'s work: the value and the ``keep`` attributes' new values (not applied)."""
    read_end, write_end = os.pipe()
    parent = os.getpid()
    with _children_lock:  # registered before anyone can see the pid (process_tree's orphans read child_pids())
        pid = os.fork()
        if pid == 0:  # the child: this thread alone; never returns
            _die_with(parent)
            _child_main(fn, read_end, write_end, owner, keep)
        _children[pid] = [label, ""]
    os.close(write_end)
    if on_fork is not None:
        on_fork(pid)
    reaped = threading.Event()
    threading.Thread(target=_reap, args=(pid, reaped), daemon=True, name="rlsup-forked-call-reaper").start()
    answer: tuple | None = None
    with os.fdopen(read_end, "rb") as pipe:
        while (message := _receive(pipe)) is not None:
            kind, body = message
            if kind == "note":
                with _children_lock:
                    if pid in _children:
                        _children[pid][1] = body
                if on_note is not None:
                    on_note(body)
            elif kind == "log":
                record = logging.makeLogRecord(body)
                logging.getLogger(record.name).handle(record)
            elif kind == "done":
                answer = body
                break
    # The child answered (or its pipe closed): it is reaped within a second, else stays listed (its exit may
    # wait on a mount: it closes its files on the way out).
    reaped.wait(REAP_WAIT_S)
    if answer is None:
        raise ChildLost(f"{label}: its child (pid {pid}) ended without an answer")
    ok, value, kept = answer
    if not ok:
        raise ChildCallFailed(value)
    return value, kept


def _child_main(fn: Callable[[], object], read_end: int, write_end: int, owner: object,
                keep: tuple[str, ...]) -> None:
    global _child_out, _children, _children_lock
    code = 0
    try:
        _children, _children_lock = {}, threading.Lock()  # the parent's, held at the fork, are not this process's
        os.close(read_end)
        _child_out = write_end
        _quiet_stdio()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)  # a stop of the node ends it; rlsup's own handlers are the parent's
        try:
            signal.set_wakeup_fd(-1)  # the parent's wakeup pipe is not this process's
        except ValueError:
            pass
        _close_pipes_and_sockets(keep=write_end)
        _forward_logs()
        try:
            value = fn()
            answer = (True, value, {name: getattr(owner, name) for name in keep})
        except BaseException as e:  # noqa: BLE001 - handed to the parent as text
            answer = (False, f"{type(e).__name__}: {e}", {name: getattr(owner, name) for name in keep})
        try:
            _send(write_end, ("done", answer))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            _send(write_end, ("done", (False, f"result not picklable: {e}", {})))
    except BaseException:  # noqa: BLE001 - a child never returns into the parent's code
        code = 1
    finally:
        os._exit(code)


def _die_with(parent: int) -> None:
    """A child ends with rlsup (PR_SET_PDEATHSIG: SIGKILL when the forking thread, which waits for the child's
    answer, or rlsup itself ends): a copy rlsup was killed in the middle of is cut off as before, never finished
    by an orphan beside the next rlsup. A child asleep in a hung mount takes the SIGKILL when the mount answers."""
    if _libc is not None and _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0 and os.getppid() != parent:
        os._exit(1)  # rlsup ended between the fork and the prctl


def _quiet_stdio() -> None:
    """/dev/null onto 0, 1 and 2: a child left in a mount must not hold rlsup's stdout and stderr open after
    rlsup exited (``| tee``, a subprocess capture or srun's I/O would wait for their EOF forever). What the
    child says travels over its pipe (:func:`note`, its log records)."""
    try:
        null = os.open(os.devnull, os.O_RDWR)
    except OSError:
        return
    for fd in (0, 1, 2):
        try:
            os.dup2(null, fd)
        except OSError:
            pass
    if null > 2:
        os.close(null)


def _close_pipes_and_sockets(keep: int) -> None:
    """The child's copies of rlsup's pipes and sockets, closed: a child left in a mount must not hold a pipe's end
    open (its reader would never see EOF) nor a connection. Told apart by /proc's link text, never a stat (an
    fstat of a file on a hung mount would hang here); regular files stay (a close would flush into the mount)."""
    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd <= 2 or fd == keep:
            continue
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(("pipe:", "socket:")):
                os.close(fd)
        except OSError:
            continue  # the listing's own descriptor, gone by now


class _Forward(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            body = dict(record.__dict__, msg=record.getMessage(), args=None, exc_info=None,
                        exc_text=self.format(record) if record.exc_info else record.exc_text)
            body.pop("message", None)
            _send(_child_out, ("log", body))  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - a log line never fails the call
            pass


def _forward_logs() -> None:
    """Every logger's records to the parent, none written here (the parent's writer keeps lines whole)."""
    handler = _Forward()
    loggers = [logging.getLogger()] + [v for v in logging.Logger.manager.loggerDict.values()
                                       if isinstance(v, logging.Logger)]
    for logger in loggers:
        for h in list(logger.handlers):
            logger.removeHandler(h)
    logging.getLogger().addHandler(handler)
    for logger in loggers:
        logger.propagate = True  # levels stay: a record is made only where the parent would make it


def _send(fd: int, message: tuple) -> None:
    data = pickle.dumps(message)
    data = struct.pack("!I", len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def _receive(pipe) -> tuple | None:
    head = pipe.read(4)
    if len(head) < 4:
        return None
    size = struct.unpack("!I", head)[0]
    data = pipe.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


def _reaped(pid: int) -> bool:
    """Reap ``pid`` if it has ended; True when it is gone (reaped now, or by someone else)."""
    try:
        done, _status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == pid


def _reap(pid: int, reaped: threading.Event) -> None:
    """Wait for ``pid``'s exit (a blocking waitpid: no polling, no SIGCHLD), then unlist it. A child whose exit
    waits on a mount keeps this daemon thread waiting (in S, not D): it dies with the process."""
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass  # reaped by someone else (left_behind's check)
    except OSError:
        return
    with _children_lock:
        _children.pop(pid, None)
    reaped.set()


def _io_moved(pid: int) -> int | None:
    """The bytes ``pid`` has read and written so far (/proc/PID/io: read off the kernel, never the mount)."""
    try:
        with open(f"/proc/{pid}/io") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith(("rchar", "wchar")))
    except (OSError, ValueError, IndexError):
        return None


def _proc_state(pid: int) -> tuple[str, str]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[-1].split()[0]
        with open(f"/proc/{pid}/wchan") as f:
            return state, f.read().strip()
    except (OSError, IndexError):
        return "", ""
