"""A small HTTP/1.1 client for etcd's gRPC gateway: one keep-alive connection, JSON POSTs, and a watch's stream.

Why not ``requests`` or ``http.client``: at 128 simulated nodes on 2 cores the client's CPU per request
was the round's largest cost. The same transaction took ~600 us of client CPU through
``requests``/``etcd3gw``, ~190 us through ``http.client`` and ~80 us here (most of it JSON), because the
gateway's answers are plain: a status line, a few headers, a body of ``Content-Length`` bytes, or for
a watch, one chunk per message. The framing is read by the one HTTP/1.1 reader
(:mod:`supervisor.transport.http11`) under this client's limits; anything else (no length, a header block
or body over its limit, a chunk that does not parse) is :class:`BadResponse` and the connection is dropped;
the caller moves on.

Every read has a deadline (a dead or partitioned member never holds a call), and the bytes already
received are kept in the connection's buffer, so a watch read that times out loses nothing.
"""

from __future__ import annotations

import socket
import ssl
import time
from dataclasses import dataclass
from functools import partial

from supervisor.transport import http11

MAX_HEAD_BYTES = 64 * 1024  # status line and headers
MAX_BODY_BYTES = 512 * 1024 * 1024  # one answer (a get_many of 128 values of etcd's 1.5 MiB request limit fits)
_RECV = 256 * 1024


class HTTPError(Exception):
    """The connection failed; it is closed and must not be reused."""

    kind = "HTTPError"


class ConnectFailed(HTTPError):
    """Nothing accepted the connection (refused, unreachable, TLS handshake failed)."""

    kind = "ConnectionFailedError"


class TimedOut(HTTPError):
    """No (complete) answer within the deadline."""

    kind = "ConnectionTimeoutError"


class Closed(HTTPError):
    """The server closed or reset the connection before the answer was complete."""

    kind = "ConnectionClosedError"


class BadResponse(HTTPError):
    """An answer that does not parse as the gateway writes them, or over its size limit."""

    kind = "BadResponse"


@dataclass(frozen=True)
class Response:
    """A complete answer."""

    status: int
    body: bytes


class Connection:
    """One HTTP/1.1 connection to ``host:port`` (TLS when ``context``), opened on first use and kept alive."""

    def __init__(self, host: str, port: int, context: ssl.SSLContext | None = None) -> None:
        self.host, self.port, self.context = host, port, context
        self.sock: socket.socket | None = None
        self._buf = bytearray()
        self._lines = bytearray()  # a stream's message bytes not yet split into lines

    @property
    def is_open(self) -> bool:
        return self.sock is not None

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = None
        self._buf.clear()
        self._lines.clear()

    def _connect(self, deadline: float) -> None:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=_left(deadline))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.context is not None:
                sock = self.context.wrap_socket(sock, server_hostname=self.host)
        except (socket.timeout, TimeoutError) as e:
            raise TimedOut(f"connect to {self.host}:{self.port}: timed out") from e
        except OSError as e:  # refused, unreachable, TLS
            raise ConnectFailed(f"connect to {self.host}:{self.port}: {e}") from e
        self.sock = sock

    def _send(self, path: str, body: bytes, deadline: float) -> None:
        if self.sock is None:
            self._connect(deadline)
        assert self.sock is not None
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1")
        try:
            self.sock.settimeout(_left(deadline))
            self.sock.sendall(head + body)
        except (socket.timeout, TimeoutError) as e:
            self.close()
            raise TimedOut("send timed out") from e
        except OSError as e:
            self.close()
            raise Closed(f"send failed: {e}") from e

    def _receive(self, deadline: float, _want: int) -> bytes:
        """The next bytes off the socket by ``deadline`` (b"": the server closed; the reader says so);
        TimedOut keeps the connection (and the buffer)."""
        assert self.sock is not None
        try:
            self.sock.settimeout(_left(deadline))
            return self.sock.recv(_RECV)
        except (socket.timeout, TimeoutError) as e:
            raise TimedOut("no answer in time") from e
        except OSError as e:
            self.close()
            raise Closed(f"receive failed: {e}") from e

    def _head(self, deadline: float) -> tuple[int, dict[str, str]]:
        try:
            return http11.read_head(self._buf, partial(self._receive, deadline), MAX_HEAD_BYTES)
        except http11.AnswerError as e:
            raise self._refused(e) from e

    def _refused(self, error: http11.AnswerError) -> HTTPError:
        """The connection closed, and the error to raise: Closed for an answer cut short, else BadResponse."""
        self.close()
        return Closed(str(error)) if error.fault is http11.Fault.CUT else BadResponse(str(error))

    def post(self, path: str, body: bytes, deadline: float) -> Response:
        """POST ``body`` (JSON) and read the whole answer by ``deadline`` (CLOCK_MONOTONIC)."""
        self._send(path, body, deadline)
        try:
            status, headers = self._head(deadline)
            if http11.is_chunked(headers):
                data = bytearray()
                while (chunk := self._chunk(deadline, MAX_BODY_BYTES - len(data))) != b"":
                    if chunk is None:
                        raise TimedOut("no complete answer in time")
                    data += chunk
            else:
                length = http11.content_length(headers, MAX_BODY_BYTES)
                data = http11.read_body(self._buf, partial(self._receive, deadline), length)
        except TimedOut:
            self.close()  # the answer may still come, out of turn
            raise
        except http11.AnswerError as e:
            raise self._refused(e) from e
        if headers.get("connection", "").lower() == "close":
            self.close()
        return Response(status, bytes(data))

    def _chunk(self, deadline: float, limit: int) -> bytes | None:
        """The next chunk's data (b"" for the last chunk), or None on a timeout before all of it arrived
        (nothing consumed: the next call starts over on the same bytes)."""
        try:
            return http11.read_chunk(self._buf, partial(self._receive, deadline), limit)
        except TimedOut:
            return None
        except http11.AnswerError as e:
            raise self._refused(e) from e

    def open_stream(self, path: str, body: bytes, deadline: float) -> int:
        """POST and read the answer's head only (a watch: a chunked stream of messages); the HTTP status."""
        self._send(path, body, deadline)
        try:
            status, headers = self._head(deadline)
        except TimedOut:
            self.close()
            raise
        if status == 200 and not http11.is_chunked(headers):
            self.close()
            raise BadResponse("a stream that is not chunked")
        return status

    def next_message(self, deadline: float, limit: int) -> bytes | None:
        """The stream's next newline-terminated message, or None when none is complete by ``deadline``.
        The stream's end is :class:`Closed`; a message over ``limit`` bytes is :class:`BadResponse`."""
        while (eol := self._lines.find(b"\n")) < 0:
            chunk = self._chunk(deadline, limit - len(self._lines))
            if chunk is None:
                return None
            if not chunk:
                self.close()
                raise Closed("the server ended the stream")
            self._lines += chunk
        line = bytes(self._lines[:eol])
        del self._lines[:eol + 1]
        return line


def _left(deadline: float) -> float:
    """Seconds to ``deadline``, at least a millisecond (a zero timeout would make the socket non-blocking)."""
    return max(0.001, deadline - time.monotonic())
