"""The background loop of a checkpoint tier: one pass now, then again every ``interval`` seconds or as
soon as a new manifest appears, until stopped.

The persistent tier and the memory tier run the same loop (and stop it the same way: after the pass in
progress, never tearing a copy), so it is written once here. A pass that raises is logged and recorded,
and the loop goes on: a tier must never take the supervisor down with it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

from supervisor.bounded_calls import forked_child, note, run_forked
from supervisor.tiers.manifest_watch import ManifestWatch

log = logging.getLogger(__name__)
#: A pass that has not ended after this many seconds is named as stalled (a slow or hung store).
STALL_S = 10.0


class PollLoop:
    """Runs ``run_pass`` in a daemon thread named ``name``; ``on_error`` receives a failed pass's error."""

    def __init__(self, run_pass: Callable[[], object], name: str, on_error: Callable[[Exception], None],
                 stall_s: float = STALL_S, on_stall: Callable[[str], None] | None = None,
                 on_thread_start: Callable[[], object] | None = None, owner: object = None,
                 keep: tuple[str, ...] | None = None, hold: threading.Lock | None = None) -> None:
        self.run_pass, self.name, self.on_error = run_pass, name, on_error
        self.on_thread_start = on_thread_start  # run first in the loop's thread (a private descriptor table)
        self.stall_s, self.on_stall = stall_s, on_stall
        # keep: each pass runs in a child forked for it (supervisor.bounded_calls.run_forked), so a pass stuck in
        # a hung mount never holds rlsup's own exit; these attributes of ``owner`` are what a pass changes.
        self.owner, self.keep = owner, keep
        # hold: the owner's lock, taken here around a forked pass (never in its child: a lock another thread
        # held at the fork stays held there forever), so what else takes it waits for the pass and its copy-back
        self.hold = hold
        self._doing = ""
        self.stalls = 0  # passes named as stalled
        self.stalled: str | None = None  # the stall line while the pass in progress is stalled
        self._pass_started: float | None = None
        self._stalled_pass: float | None = None  # the start of the pass that ``stalled`` names
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: ManifestWatch | None = None

    @property
    def doing(self) -> str:
        """What the pass in progress is doing now (set by the tier), for the stall line."""
        return self._doing

    @doing.setter
    def doing(self, text: str) -> None:
        self._doing = text
        if forked_child():
            note(text)  # the parent's loop sees it (a forked pass)

    def call(self, fn: Callable[[], object]) -> object:
        """``fn()`` as a pass runs: in a forked child when the loop forks its passes."""
        if self.keep is None or forked_child():
            return fn()
        if self.hold is None:
            return run_forked(fn, self.name, self.owner, self.keep, on_note=self._noted)
        with self.hold:
            return run_forked(fn, self.name, self.owner, self.keep, on_note=self._noted)

    def _noted(self, text: str) -> None:
        self._doing = text

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, interval: float, watch: str | os.PathLike | None = None,
              wakes_on: Callable[[str, str], bool] | None = None, recursive: bool = True) -> None:
        """Start the thread (no-op while it runs); ``watch``: a directory whose new manifests (or the events
        ``wakes_on(path, event_type)`` names) wake it. A watch that cannot start raises, and nothing started."""
        if self.running():
            return
        self._stop.clear()
        if watch is not None:
            if wakes_on is None:
                found = ManifestWatch(watch, self.wake, recursive=recursive)
            else:
                found = ManifestWatch(watch, self.wake, wakes_on, recursive)
            found.start()
            self._watch = found
        self._thread = threading.Thread(target=self._loop, args=(interval,), name=self.name, daemon=True)
        self._thread.start()
        threading.Thread(target=self._watchdog, args=(self._thread,), name=f"{self.name}-watchdog", daemon=True).start()

    def _watchdog(self, thread: threading.Thread) -> None:
        """Name a pass that has run past ``stall_s`` (once per pass), and its end when it comes."""
        named: float | None = None
        while thread.is_alive():
            started = self._pass_started
            if started is not None and named != started and time.monotonic() - started > self.stall_s:
                named, self.stalls = started, self.stalls + 1
                self._stalled_pass = started
                self.stalled = (f"{self.name}: a pass has not ended in {time.monotonic() - started:.0f}s "
                                f"({self.doing or 'its pass'}): the store is slow or not answering; "
                                "training, hang detection and metrics go on without it")
                log.warning(self.stalled)
                if self.on_stall is not None:
                    self.on_stall(self.stalled)
            elif named is not None and started != named:
                log.info("%s: the stalled pass ended after all", self.name)
                named, self.stalled = None, None
            time.sleep(min(1.0, self.stall_s / 4))

    def stuck(self) -> bool:
        """Whether the pass running now has been named stalled (its thread may never come back). A stall line
        left from an earlier pass (the watchdog clears it within a second) does not count."""
        started = self._pass_started
        return self.stalled is not None and started is not None and started == self._stalled_pass

    def _loop(self, interval: float) -> None:
        if self.on_thread_start is not None:
            self.on_thread_start()
        while not self._stop.is_set():
            self._pass_started = time.monotonic()
            try:
                self.call(self.run_pass)
            except Exception as e:  # see the module docstring
                self.on_error(e)
                log.exception("%s: pass failed", self.name)
            finally:
                self._pass_started, self._doing = None, ""
            self.wake.wait(interval)
            self.wake.clear()

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop after the pass in progress (waits at most ``timeout`` for it, and no longer once it is named
        stalled)."""
        self._stop.set()
        self.wake.set()
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        if self._thread is not None:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self._thread.is_alive() and not self.stuck() and (deadline is None or time.monotonic() < deadline):
                self._thread.join(0.1)  # a pass named stalled meanwhile is not waited for any longer
            self._thread = None
