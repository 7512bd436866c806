"""Rank-side heartbeats, sections and the stop flag, through one small shared-memory file per rank.

Why a memory-mapped file and not a socket: a heartbeat must cost microseconds and never block, even
when the supervisor is slow, stopped or gone. Writing a few integers into a page that rlsup also maps
is a memory store, no system call; rlsup reads the page whenever it likes. Clocks are
``time.monotonic_ns`` (CLOCK_MONOTONIC is system-wide on Linux), so wall-clock jumps never look like
hangs.

The record layout, shared with the supervisor that reads it, is in :mod:`rlsup_format.heartbeat_record`.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import mmap
import os
import signal
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

from rlsup_format import job_env
from rlsup_format.heartbeat_record import (  # noqa: F401 - re-exported for rank-side callers
    I64 as _I64,
    MAGIC,
    RECORD,
    RECORD_SIZE,
    SECTION_NAMES,
    SECTIONS,
    STACKS_SIGNAL,
    STOP_OFFSET,
    HeartbeatRecord,
    rank_file_name,
    read_record,
    request_stop,
    stacks_file_name,
)


_BEFORE_STOP = struct.Struct("<7q")  # fields 0-6, up to STOP_OFFSET
_AFTER_STOP = struct.Struct("<6q")  # fields 8-13 (RECORD's 8-9, then EXTRA's 10-13)
_WORK = SECTIONS["work"]


class _Writer:
    """The rank's open heartbeat file; created on first use, only under rlsup."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.path = directory / rank_file_name(rank)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, RECORD_SIZE)
            self.map = mmap.mmap(fd, RECORD_SIZE)
        finally:
            os.close(fd)
        self.seq = 0
        self.step = -1
        self.beat_ns = 0
        self.section = 0
        self.section_ns = 0
        self.saves = 0
        self.save_ns = 0
        self._save_started = 0
        self.prev_step = -1
        self.prev_beat_ns = 0
        self.works = 0
        self.work_ns = 0
        self._work_started = 0
        self._publish()
        atexit.register(self.exiting)
        _die_with_parent()
        # Stack dumps on demand: rlsup sends STACKS_SIGNAL before killing a hung rank.
        self._stacks = open(directory / stacks_file_name(rank), "w")  # lives with the process
        if threading.current_thread() is threading.main_thread():
            faulthandler.register(STACKS_SIGNAL, file=self._stacks, all_threads=True, chain=False)
        # Flight Recorder dumps on demand: a thread on a FIFO, since a hung collective holds the main thread.
        from trainer_hooks.flight_recorder import start_listener

        start_listener(directory, rank)

    def _publish(self) -> None:
        """Write every field but the stop flag, which belongs to rlsup: re-writing a value read a moment
        earlier would lose a stop request that landed in between."""
        m = self.map
        self.seq += 1
        _I64.pack_into(m, 0, self.seq)
        _BEFORE_STOP.pack_into(m, 0, self.seq, MAGIC, os.getpid(), self.step, self.beat_ns, self.section,
                               self.section_ns)
        _AFTER_STOP.pack_into(m, STOP_OFFSET + _I64.size, self.saves, self.save_ns, self.prev_step,
                              self.prev_beat_ns, self.works, self.work_ns)
        self.seq += 1
        _I64.pack_into(m, 0, self.seq)

    def beat(self, step: int) -> None:
        self.prev_step, self.prev_beat_ns = self.step, self.beat_ns
        self.step = step
        self.beat_ns = time.monotonic_ns()
        self._publish()

    def work(self, starting: bool) -> None:
        """A ``work`` section: timed on its own, never the current section (timeouts stay the step's)."""
        now = time.monotonic_ns()
        if starting:
            self._work_started = now
            return
        self.works += 1
        self.work_ns = now - self._work_started
        self._publish()

    def set_section(self, code: int) -> None:
        now = time.monotonic_ns()
        save = SECTIONS["save"]
        if code == save and self.section != save:
            self._save_started = now
        elif self.section == save and code != save:  # nested save sections count once, outermost
            self.saves += 1
            self.save_ns = now - self._save_started
        self.section = code
        self.section_ns = now
        self._publish()

    def exiting(self) -> None:
        """At interpreter exit, after the last step: the teardown that follows (module and GC teardown
        of a large heap can take seconds on a loaded node) is held to save_timeout, not taken for a hang."""
        self.set_section(SECTIONS["exit"])

    def stop_requested(self) -> bool:
        return _I64.unpack_from(self.map, STOP_OFFSET)[0] != 0


# The launcher as seen when this module was imported (reset in a forked child): the parent that
# PR_SET_PDEATHSIG must follow. Compared after every prctl, so a launcher that died between the import
# and the arming still takes the rank with it.
_parent_at_import = os.getppid()


def _after_fork_in_child() -> None:
    global _parent_at_import
    _parent_at_import = os.getppid()  # the kernel clears PDEATHSIG in a child: its parent is the forker


os.register_at_fork(after_in_child=_after_fork_in_child)


def _die_with_parent() -> None:
    """Under rlsup, a rank dies with its launcher (torchrun), so a SIGKILLed node leaves no orphan ranks.

    Armed when trainer_hooks is imported under rlsup (:func:`_arm_at_import`) and again when the
    heartbeat writer is created (idempotent). As always with PR_SET_PDEATHSIG, "parent" is the thread
    that created this process (torchrun's agent starts its workers from its main thread). If the parent
    seen at import is already gone when the prctl is made, the rank kills itself."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != _parent_at_import:  # the launcher died before the call
            os.kill(os.getpid(), signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _arm_at_import() -> None:
    """Arm die-with-parent as soon as trainer_hooks is imported under rlsup, not only at the first
    heartbeat: a rank killed or stuck before its first heartbeat (in ``init_process_group``, loading
    data) must not outlive a SIGKILLed launcher. Not in the async checkpoint writer, which arms itself
    only when its creator is a main thread (its parent thread may be a short-lived one)."""
    if not os.environ.get(job_env.HEARTBEAT_DIR):
        return
    argv = list(getattr(sys, "orig_argv", ()))
    if "-m" in argv and argv[argv.index("-m") + 1:argv.index("-m") + 2] == ["trainer_hooks.async_writer"]:
        return
    _die_with_parent()


_lock = threading.Lock()
_writer: _Writer | None = None
_initialised = False
# Set by the stop handlers: a plain assignment, never a lock. A handler runs between two bytecodes of
# whatever the main thread is doing, including an earlier run of itself: rlsup, torchrun, SLURM or the
# user may send SIGTERM again a moment later, and a second handler that waited for a lock the first one
# held (threading.Event.set does) would hang the rank for good, ignoring the stop flag too.
_stop_signalled = False


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def _get_writer() -> _Writer | None:
    global _writer, _initialised
    if _initialised:
        return _writer
    with _lock:
        if not _initialised:
            # Handlers first: once the heartbeat file is visible, rlsup may send SIGTERM at any moment.
            _install_stop_handlers()
            directory = os.environ.get(job_env.HEARTBEAT_DIR)
            if directory:
                _writer = _Writer(Path(directory), _rank())
            _initialised = True
    return _writer


def _install_stop_handlers() -> None:
    """SIGTERM and the preemption signal turn should_stop() true instead of killing the rank mid-step."""
    if threading.current_thread() is not threading.main_thread():
        return
    names = {"SIGTERM"}
    extra = os.environ.get(job_env.PREEMPT_SIGNAL)
    if extra:
        names.add(extra if extra.startswith("SIG") else "SIG" + extra)
    for name in names:
        signum = getattr(signal, name, None)
        if signum is None:
            continue
        if signal.getsignal(signum) in (signal.SIG_DFL, None):
            signal.signal(signum, _on_stop_signal)


def _on_stop_signal(_signum: int, _frame: object) -> None:
    """Re-entrant: it only assigns (see :data:`_stop_signalled`)."""
    global _stop_signalled
    _stop_signalled = True


def heartbeat(step: int) -> None:
    """Tell rlsup this rank is alive at ``step``. A few microseconds; a no-op outside rlsup."""
    w = _writer if _initialised else _get_writer()
    if w is not None:
        w.beat(step)


def should_stop() -> bool:
    """True once rlsup (or SIGTERM / the preemption signal) asks the job to save and exit."""
    w = _writer if _initialised else _get_writer()
    return _stop_signalled or (w is not None and w.stop_requested())


@contextlib.contextmanager
def section(name: str) -> Iterator[None]:
    """Mark a long phase (``save``, ``load``) so rlsup applies that phase's timeout, not the step timeout;
    or ``work``: the rank's own compute of a step (forward/backward, before its collectives), so rlsup
    can tell a straggler from its peers when the heartbeat comes after the step's all-reduce."""
    code = SECTIONS[name]
    w = _get_writer()
    if w is None:
        yield
        return
    if code == _WORK:  # the rank's own forward/backward, for straggler detection (a few microseconds)
        w.work(True)
        try:
            yield
        finally:
            w.work(False)
        return
    previous = w.section
    w.set_section(code)
    try:
        yield
    finally:
        w.set_section(previous)


_arm_at_import()  # last: everything it needs is defined
