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
from typing import Callable

from supervisor.tiers.manifest_watch import ManifestWatch

log = logging.getLogger(__name__)


class PollLoop:
    """Runs ``run_pass`` in a daemon thread named ``name``; ``on_error`` receives a failed pass's error."""

    def __init__(self, run_pass: Callable[[], object], name: str, on_error: Callable[[Exception], None]) -> None:
        self.run_pass, self.name, self.on_error = run_pass, name, on_error
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: ManifestWatch | None = None

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, interval: float, watch: str | os.PathLike | None = None) -> None:
        """Start the thread (no-op while it runs); ``watch``: a directory whose new manifests wake it."""
        if self.running():
            return
        self._stop.clear()
        if watch is not None:
            self._watch = ManifestWatch(watch, self.wake)
            self._watch.start()
        self._thread = threading.Thread(target=self._loop, args=(interval,), name=self.name, daemon=True)
        self._thread.start()

    def _loop(self, interval: float) -> None:
        while not self._stop.is_set():
            try:
                self.run_pass()
            except Exception as e:  # see the module docstring
                self.on_error(e)
                log.exception("%s: pass failed", self.name)
            self.wake.wait(interval)
            self.wake.clear()

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop after the pass in progress (waits at most ``timeout`` for it)."""
        self._stop.set()
        self.wake.set()
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
