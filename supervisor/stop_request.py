"""rlsup asked to stop: SIGTERM/SIGINT stop the run, the preemption signal preempts it (exit for requeue).

Set from signal handlers (or :meth:`StopRequest.ask`, from any other thread), polled by the run loop:
between attempts the backoff waits on an Event the request wakes, while an attempt runs the watch
polls it every ``poll_interval``, and every wait of the nodes' coordination (the store's connect, the
joins, the round's waits) asks :meth:`StopRequest.check` at each poll: a stop ends it with
:class:`StopAsked`, which the run loop records as the stop it is (never a timeout, never a failure).
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from supervisor import exit_codes
from supervisor.lifecycle import EndReason


class StopAsked(Exception):
    """rlsup was asked to stop while it waited for something (the nodes, the store): the wait ends at once."""

    def __init__(self, message: str, exit_code: int, reason: EndReason) -> None:
        super().__init__(message)
        self.exit_code, self.reason = exit_code, reason


class StopRequest:
    """Whether, and how, rlsup was asked to stop; one per run."""

    def __init__(self, preempt_signal: signal.Signals) -> None:
        self.preempt_signal = preempt_signal
        self.signum: int | None = None  # the signal that asked (None: nobody asked)
        self.asks = 0  # how many times it was asked (a stop after a given moment: the count grew since)
        self.preempted = False
        self._wake = threading.Event()

    @property
    def asked(self) -> bool:
        return self.signum is not None

    def note(self, signum: int, preempted: bool = False) -> None:
        """The signal handlers': assignments, no lock (a handler runs inside the main thread's Event.wait or
        an earlier handler's Event.set, whose lock it would wait for forever); the loop polls them."""
        self.preempted = self.preempted or preempted
        self.signum = signum
        self.asks += 1

    def ask(self, signum: int, preempted: bool = False) -> None:
        """Stop the run (from any thread but a signal handler): the backoff wait wakes at once."""
        self.note(signum, preempted)
        self._wake.set()

    def wait(self, delay: float, poll_interval: float) -> bool:
        """Wait ``delay``; True as soon as a stop is asked (a signal's within a ``poll_interval``: :meth:`note`)."""
        deadline = time.monotonic() + delay
        while not self.asked and (left := deadline - time.monotonic()) > 0:
            self._wake.wait(min(left, poll_interval))
        return self.asked

    def check(self, waiting_for: str) -> None:
        """Raise :class:`StopAsked` when a stop was asked: the one rule every wait outside an attempt polls."""
        if self.signum is not None:
            raise StopAsked(f"rlsup was asked to stop ({self.describe()}) while waiting for {waiting_for}",
                            self.exit_code(), self.reason)

    def describe(self) -> str:
        """The signal that asked, by name (``SIGTERM``; ``SIGUSR1, preemption``)."""
        try:
            name = signal.Signals(self.signum or signal.SIGTERM).name
        except ValueError:
            name = f"signal {self.signum}"
        return f"{name}, preemption" if self.preempted else name

    @property
    def reason(self) -> EndReason:
        """What the attempt it ended is recorded as."""
        return EndReason.PREEMPTED if self.preempted else EndReason.STOPPED

    def exit_code(self) -> int:
        """REQUEUE when preempted, else 128+signal."""
        return exit_codes.REQUEUE if self.preempted else exit_codes.from_signal(self.signum or signal.SIGTERM)

    def install(self) -> dict[int, Any]:
        """SIGTERM/SIGINT stop, the preemption signal preempts; the handlers they replace, for
        :meth:`restore` (main thread only: elsewhere nothing is installed, {})."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        handlers = {signal.SIGTERM: lambda signum, _f: self.note(signum),
                    signal.SIGINT: lambda signum, _f: self.note(signum),
                    self.preempt_signal: lambda signum, _f: self.note(signum, preempted=True)}
        return {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}

    @staticmethod
    def restore(previous: dict[int, Any]) -> None:
        """Put back the handlers :meth:`install` replaced (a second run in this process starts clean)."""
        for signum, handler in previous.items():
            signal.signal(signum, handler)
