"""Calls into a directory that may stop answering, made from a thread that must not stop with them.

A read of a hung NFS, Lustre or FUSE mount blocks the calling thread in the kernel, and no signal gets it
back. The run loop polls heartbeats and detects hangs; it must never be that thread. So such a call runs in a
daemon thread given a deadline: past it the caller goes on with a default answer and the call is named once;
while it is still blocked, later calls are not started beside it (one stuck thread per store, not one per
poll). A thread blocked in the kernel cannot be joined or killed: it is left, and ends when the mount answers.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class BoundedCalls:
    """Calls named ``what`` (e.g. "reading the checkpoint directory /ckpt"), each given ``deadline_s``."""

    def __init__(self, what: str, deadline_s: float, prepare: Callable[[], object] | None = None) -> None:
        self.what, self.deadline_s = what, deadline_s
        self.prepare = prepare  # run first in each call's thread (e.g. a private descriptor table)
        self.blocked_since: float | None = None  # a call that outlived its deadline and has not returned yet
        self.timeouts = 0
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], T], default: T, progress: Callable[[], object] | None = None,
             on_give_up: Callable[[], object] | None = None) -> T:
        """``fn()``, or ``default`` when it has not returned within the deadline or an earlier call is still
        blocked. ``progress`` (e.g. bytes copied so far): while its value changes the deadline starts again, so
        a long copy that moves is never cut, one that stops moving is. ``on_give_up``: run when the caller goes on
        without the call (e.g. it tells a fetch that its result is no longer wanted). Exceptions of ``fn`` reach
        the caller."""
        if self.blocked_since is not None:
            return default
        box: list[tuple[bool, object]] = []
        done = threading.Event()
        finished: list[bool] = []  # set under the lock: the caller names the call blocked only while it runs

        def run() -> None:
            try:
                if self.prepare is not None:
                    self.prepare()
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
        if not ok:
            raise value  # type: ignore[misc]
        return value  # type: ignore[return-value]

    def _wait(self, done: threading.Event, progress: Callable[[], object] | None) -> bool:
        """Whether ``done`` came before ``deadline_s`` passed without ``progress`` changing."""
        if progress is None:
            return done.wait(self.deadline_s)
        seen, since = progress(), time.monotonic()
        while not done.wait(min(1.0, self.deadline_s)):
            now = progress()
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since >= self.deadline_s:
                return False
        return True
