"""The connections a replication server holds: what its eviction rule needs to know of each, and the
protocol wrappers that keep that table (aiohttp exposes no connection hooks). The rule itself (who is
evicted when the table is full) is :meth:`supervisor.transport.server.ReplicationServer._make_room`."""

from __future__ import annotations

import asyncio
import time
from typing import Any


class Reject(asyncio.Protocol):
    """Protocol for connections over the limit: closed as soon as they are accepted."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class HeldConn:
    """What eviction needs to know of one held connection (kept by the server, keyed by its handler)."""

    __slots__ = ("transport", "since", "trusted", "busy")

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.since = time.monotonic()  # accepted, or last complete request head / response end
        self.trusted = False  # has sent an authenticated request: a peer, evicted after strangers
        self.busy = 0  # requests being served: never evicted while > 0

    def evict_key(self) -> tuple[bool, float]:
        return self.trusted, self.since


class Tracked(asyncio.Protocol):
    """Wraps aiohttp's handler to learn when a connection is made and lost (aiohttp exposes no hook).
    The hot path (data_received and flow control) is bound straight to the handler: no extra call."""

    def __init__(self, handler: asyncio.Protocol, conns: dict[Any, HeldConn]) -> None:
        self._handler = handler
        self._conns = conns
        self.data_received = handler.data_received  # type: ignore[method-assign]
        self.eof_received = handler.eof_received  # type: ignore[method-assign]
        self.pause_writing = handler.pause_writing  # type: ignore[method-assign]
        self.resume_writing = handler.resume_writing  # type: ignore[method-assign]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._conns[self._handler] = HeldConn(transport)
        self._handler.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._conns.pop(self._handler, None)
        self._handler.connection_lost(exc)
