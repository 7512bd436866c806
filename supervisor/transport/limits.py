"""Limits shared by the transfers of a process: a bandwidth cap (token bucket) and a bound on how
many file transfers run at once. Both are thread-safe and know nothing of HTTP."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

#: Default burst of a limiter: one transfer chunk.
CHUNK = 1 << 20


class BandwidthLimiter:
    """Token bucket of ``bytes_per_second`` (0/None: unlimited) with ``burst`` bytes of credit.

    Thread-safe and loop-agnostic, so one instance can cap every client of a process. Implemented as
    a virtual clock: each grant of n bytes pushes the earliest time of the next grant by n/rate;
    a caller sleeps until its grant's time. Idle time accrues at most ``burst`` bytes of credit.
    """

    def __init__(self, bytes_per_second: float | None, burst: int | None = None) -> None:
        self.rate = float(bytes_per_second or 0)
        self.burst = float(burst if burst is not None else max(CHUNK, self.rate / 10))
        self._next = 0.0
        self._lock = threading.Lock()

    @property
    def unlimited(self) -> bool:
        return self.rate <= 0

    def reserve(self, n: int) -> float:
        """Book ``n`` bytes and return the seconds the caller must wait before they pass (GCRA: rate
        plus ``burst`` of slack). The caller sleeps; knowing the wait first lets a transfer move its
        overall deadline by it (:meth:`supervisor.transport.wire.Deadline.throttle`)."""
        if self.unlimited or n <= 0:
            return 0.0
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next, now) + n / self.rate
            return max(0.0, self._next - self.burst / self.rate - now)

    def consume(self, n: int) -> None:
        """Block the calling thread until ``n`` bytes may pass."""
        wait = self.reserve(n)
        if wait > 0:
            time.sleep(wait)


class TransferPool:
    """Bounds concurrent transfers: give the same pool to several clients (``PeerClient(pool=...)``)
    and at most ``max_concurrent`` of their file transfers run at once; ``submit``/``map`` also run
    callables on ``max_concurrent`` worker threads (``pool.map(lambda f: client.push_file(...), files)``).
    """

    def __init__(self, max_concurrent: int) -> None:
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be >= 1")
        self.max_concurrent = max_concurrent
        self._sem = threading.BoundedSemaphore(max_concurrent)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @contextmanager
    def slot(self) -> Iterator[None]:
        with self._sem:
            yield

    def submit(self, fn: Callable, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(self.max_concurrent,
                                                                       thread_name_prefix="rlsup-xfer")
        return self._executor.submit(fn, *args, **kwargs)

    def map(self, fn: Callable, items) -> list:
        """Run ``fn`` on every item, at most ``max_concurrent`` at once; results in order, first error raised."""
        return [f.result() for f in [self.submit(fn, x) for x in items]]

    def shutdown(self) -> None:
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
