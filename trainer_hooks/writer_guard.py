"""The async checkpoint writer's guard: relayed stop signals ignored, die-with-parent armed.

Armed at import, before the writer imports torch (1-2 s, far longer on loaded cores): the writer starts
when its manager is built, so a stop that rlsup relays to the job's process group during the trainer's
restore, or a SIGKILLed trainer, would otherwise find a writer still importing, unguarded. Light on
purpose (no torch): :mod:`trainer_hooks.async_writer` imports it first. The interpreter's own start-up
before that import (tens of ms) is covered by :func:`blocked_while_spawning`: the trainer's thread blocks
these signals around the spawn, the writer inherits the mask, and :func:`guard` ignores then unblocks them
(a signal that came meanwhile is dropped).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Iterator

from rlsup_format import job_env

WRITER_MODULE = "trainer_hooks.async_writer"
#: rlsup relays these to the job: the trainer handles them and flushes; the writer keeps writing until told.
IGNORED_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP")


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent`` dies (``PR_SET_PDEATHSIG``); exit at once if it already did."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def relayed_signals() -> set[int]:
    names = set(IGNORED_SIGNALS)
    preempt = os.environ.get(job_env.PREEMPT_SIGNAL)
    if preempt:
        names.add(preempt if preempt.startswith("SIG") else "SIG" + preempt)
    return {signum for name in names if (signum := getattr(signal, name, None)) is not None}


def ignore_relayed_signals() -> None:
    signums = relayed_signals()
    for signum in signums:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signums)  # blocked by the spawn: pending ones are dropped


@contextlib.contextmanager
def blocked_while_spawning() -> Iterator[None]:
    """Block the relayed signals in this (the trainer's) thread while the writer is spawned; one sent meanwhile
    reaches the trainer when the block ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, relayed_signals())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def guard(parent: int, with_parent: bool) -> None:
    """Both, as the writer's first act; ``with_parent`` only when its creator was a main thread
    (``PR_SET_PDEATHSIG`` follows the creating thread)."""
    ignore_relayed_signals()
    if with_parent:
        die_with_parent(parent)


def _arm_at_import() -> None:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if getattr(spec, "name", None) != WRITER_MODULE:
        return  # imported by a trainer, not run as the writer
    argv = sys.argv[1:]
    try:
        parent = int(argv[argv.index("--parent") + 1])
    except (ValueError, IndexError):
        return  # writer_main's argument parser says what is wrong
    guard(parent, "--die-with-parent" in argv)


_arm_at_import()
