"""The async checkpoint writer's guard: relayed stop signals ignored, die-with-parent armed.

Armed at import, before the writer imports torch (1-2 s, far longer on loaded cores): the writer starts
when its manager is built, so a stop that rlsup relays to the job's process group during the trainer's
restore, or a SIGKILLed trainer, would otherwise find a writer still importing, unguarded. Light on
purpose (no torch): :mod:`trainer_hooks.async_writer` imports it first.
"""

from __future__ import annotations

import os
import signal
import sys

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


def ignore_relayed_signals() -> None:
    names = set(IGNORED_SIGNALS)
    preempt = os.environ.get("RLSUP_PREEMPT_SIGNAL")
    if preempt:
        names.add(preempt if preempt.startswith("SIG") else "SIG" + preempt)
    for name in names:
        signum = getattr(signal, name, None)
        if signum is not None:
            signal.signal(signum, signal.SIG_IGN)


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
