"""An upload's body straight off its socket, not through aiohttp's body handling: after the request
head, reading is paused, what aiohttp already buffered is handed over, and a worker thread reads the
rest with ``recv_into`` into 8 MiB buffers that a second thread hashes and writes
(:func:`supervisor.transport.wire.receive_to_fd`). Why: aiohttp hands a body over in 64-256 KiB
pieces through its parser and queues, which costs more CPU per GB than the kernel's copies (issue 17).
Not under TLS (the socket carries ciphertext): there the server reads the body through aiohttp.

aiohttp has no API that hands a request's body socket to the application, so the takeover is built
from public calls only: ``request.transport`` and asyncio's ``get_extra_info("socket")`` and
``pause_reading``, the body stream's ``read_nowait``, ``total_bytes`` and ``feed_eof``; no private
attribute of aiohttp is touched, and :func:`take_socket` checks that nothing buffered was lost."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket
from typing import Any

from aiohttp import web

from rlsup_format.digest import FileEntry
from supervisor.transport import wire


class HTTPError(Exception):
    """A request the server answers with ``status`` and ``message`` (JSON ``{"error": message}``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def take_socket(request: web.Request) -> tuple[socket.socket, bytes] | None:
    """Take the body's socket over from aiohttp: reading paused, what it buffered handed over, and a
    duplicate of the socket (still non-blocking: its timeout waits with poll) for a worker thread.
    None when there is no plain socket under the request."""
    transport = request.transport
    raw = transport.get_extra_info("socket") if transport is not None else None
    if raw is None:
        return None
    transport.pause_reading()
    parts = []
    # Reading what was buffered may resume reading (flow control), and resuming hands over what the
    # paused parser still held: read until nothing is left, then pause again before any await.
    while chunk := request.content.read_nowait(-1):
        parts.append(chunk)
    transport.pause_reading()
    first = b"".join(parts)
    if len(first) != request.content.total_bytes:
        raise HTTPError(500, "could not take the body over from the HTTP parser")
    return socket.socket(fileno=os.dup(raw.fileno())), first


async def receive_raw(request: web.Request, inc: Any, sock: socket.socket, first: bytes,
                      pool: concurrent.futures.Executor, stall: float) -> FileEntry:
    """The rest of the body into ``inc`` (an incoming store file) and its commit, on ``pool`` (an upload
    may take long). Cancelled (a shutdown): the socket is shut so the worker stops, and waited for
    before the caller aborts the file (never under a running write)."""
    fut = asyncio.get_running_loop().run_in_executor(pool, _receive, inc, sock, first, stall)
    try:
        entry = await asyncio.shield(fut)
    except asyncio.CancelledError:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        await asyncio.wait([fut])
        raise
    request.content.feed_eof()  # the body is complete: aiohttp need not linger for it
    return entry


def _receive(inc: Any, sock: socket.socket, first: bytes, stall: float) -> FileEntry:
    no_deadline = wire.Deadline(0.0, 0.0)  # stalls are bounded; the connection table bounds the rest
    try:
        inc.receive_with(lambda fd, hasher, n: wire.receive_to_fd(sock, first, fd, n, stall, no_deadline,
                                                                  hasher=hasher))
    except (TimeoutError, wire.DeadlineExpired):
        raise HTTPError(408, f"body stalled for {stall}s") from None
    except (wire.WireError, ConnectionError) as e:
        raise HTTPError(400, f"body incomplete: {e}") from None
    return inc.commit()
