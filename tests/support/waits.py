"""Polls with deadlines: a test never sleeps and hopes, it waits for what it needs and fails naming it."""

from __future__ import annotations

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
