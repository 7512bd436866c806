"""Polls with deadlines: a test never sleeps and hopes, it waits for what it needs and fails naming it."""

from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")


class Deadline(AssertionError):
    """A wait ran out of time (an AssertionError, so a test fails on it like on any assertion)."""


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy and return that; raise :class:`Deadline` naming
    ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise Deadline(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def in_thread(call: Callable[[], object], deadline_s: float) -> Callable[[], object]:
    """Start ``call`` on a thread now; the returned call waits (at most ``deadline_s``) for what it returned or
    raised, and fails the test when it has not ended by then."""
    out: list[object] = []

    def body() -> None:
        try:
            out.append(call())
        except BaseException as e:  # handed to the test
            out.append(e)

    t = threading.Thread(target=body, daemon=True)
    t.start()

    def result() -> object:
        t.join(deadline_s)
        assert not t.is_alive() and out, f"the call did not end within {deadline_s}s"
        return out[0]
    return result
