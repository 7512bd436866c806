"""The one HTTP/1.1 answer reader, for the two clients that talk to servers whose answers are plain: etcd's
gRPC gateway (:mod:`supervisor.cluster.etcd_http`) and our own replica server (:mod:`supervisor.transport.wire`).
An answer is a status line, headers, then a body of ``Content-Length`` bytes or a series of chunks.

Why one reader: each client had its own copy of these rules, with its own limits and errors. The rules
live here; each caller keeps what is its own: the socket and its timeouts (``receive`` raises them, and
nothing is taken from the buffer until it is complete, so a read that timed out can start over on the same
bytes), its limits (parameters), and what a refusal means to it (:class:`AnswerError` names its
:class:`Fault`: a cut answer is worth another try, a malformed or oversized one is not).
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Callable, Mapping

#: ``receive(want)``: up to about ``want`` more bytes (more is kept for the next answer), ``b""`` once the
#: peer closed. Its own errors (a timeout, a reset) pass through the reader unchanged.
Receive = Callable[[int], bytes]

#: Bytes asked of ``receive`` at a time while a head or a chunk is incomplete.
RECEIVE_SIZE = 65536
#: The longest chunk-size line taken (hex size and extensions); the gateway writes a few bytes.
MAX_CHUNK_SIZE_LINE = 32

_HEX = re.compile(rb"[0-9A-Fa-f]+")


class Fault(Enum):
    """What was wrong with an answer."""

    CUT = "cut"  # the peer closed the connection before the answer was complete
    GARBLED = "garbled"  # a status line, header line or chunk framing that does not parse
    NO_LENGTH = "no length"  # no valid Content-Length where one is required (chunked, absent, not a number)
    OVER_LIMIT = "over limit"  # a head, body or chunk larger than the caller's limit


class AnswerError(Exception):
    """An answer refused or cut short; the message names what was wrong."""

    def __init__(self, fault: Fault, message: str) -> None:
        super().__init__(message)
        self.fault = fault


def read_head(buf: bytearray, receive: Receive, max_head: int) -> tuple[int, dict[str, str]]:
    """The next answer's status code and headers (names lower-cased), taken from the front of ``buf``, which
    ``receive`` fills as needed; the bytes after the head stay in ``buf``. At most ``max_head`` bytes."""
    while (end := buf.find(b"\r\n\r\n")) < 0:
        if len(buf) > max_head:
            raise AnswerError(Fault.OVER_LIMIT, f"status line and headers over {max_head} bytes")
        if not _fill(buf, receive, RECEIVE_SIZE):
            raise AnswerError(Fault.CUT, f"connection closed before a complete answer head ({len(buf)} bytes came)")
    if end > max_head:
        raise AnswerError(Fault.OVER_LIMIT, f"status line and headers over {max_head} bytes")
    status_line, *lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not (code.isascii() and code.isdigit()):
        raise AnswerError(Fault.GARBLED, f"malformed status line (not HTTP/1.x): {status_line[:80]!r}")
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep:
            raise AnswerError(Fault.GARBLED, f"malformed header line (no colon): {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    del buf[:end + 4]
    return int(code), headers


def is_chunked(headers: Mapping[str, str]) -> bool:
    """Whether the body comes in chunks (then it has no Content-Length)."""
    return "chunked" in headers.get("transfer-encoding", "").lower()


def content_length(headers: Mapping[str, str], limit: int | None = None) -> int:
    """The body's declared length: refused when the answer is chunked, has no valid Content-Length, or
    declares more than ``limit`` bytes (None: no limit)."""
    if is_chunked(headers):
        raise AnswerError(Fault.NO_LENGTH, "chunked answer (a Content-Length is required)")
    value = headers.get("content-length", "")
    if not (value.isascii() and value.isdigit()):
        raise AnswerError(Fault.NO_LENGTH, f"answer lacks a valid Content-Length (got {value[:40]!r})")
    length = int(value)
    if limit is not None and length > limit:
        raise AnswerError(Fault.OVER_LIMIT, f"answer body of {length} bytes exceeds the limit of {limit}")
    return length


def read_body(buf: bytearray, receive: Receive, length: int) -> bytes:
    """Exactly ``length`` body bytes from the front of ``buf``, which ``receive`` fills as needed (asked for
    no more than the body still lacks)."""
    while len(buf) < length:
        if not _fill(buf, receive, length - len(buf)):
            raise AnswerError(Fault.CUT, f"answer truncated at {len(buf)} of {length} bytes (the connection closed)")
    data = bytes(buf[:length])
    del buf[:length]
    return data


def read_chunk(buf: bytearray, receive: Receive, limit: int) -> bytes:
    """The next chunk's data (``b""``: the last chunk), of at most ``limit`` bytes, from the front of
    ``buf``, which ``receive`` fills as needed. Nothing is taken from ``buf`` until the chunk is whole."""
    while True:
        eol = buf.find(b"\r\n")
        if eol > MAX_CHUNK_SIZE_LINE or (eol < 0 and len(buf) > MAX_CHUNK_SIZE_LINE):
            raise AnswerError(Fault.GARBLED, f"a chunk size line over {MAX_CHUNK_SIZE_LINE} bytes")
        if eol >= 0:
            size_text = bytes(buf[:eol]).split(b";", 1)[0].strip()
            if not _HEX.fullmatch(size_text):
                raise AnswerError(Fault.GARBLED, f"a chunk size that does not parse: {size_text[:20]!r}")
            size = int(size_text, 16)
            if size > limit:
                raise AnswerError(Fault.OVER_LIMIT, f"a chunk of {size} bytes, over the limit of {limit}")
            if len(buf) >= eol + 4 + size:
                if buf[eol + 2 + size:eol + 4 + size] != b"\r\n":
                    raise AnswerError(Fault.GARBLED, "a chunk not followed by CRLF")
                data = bytes(buf[eol + 2:eol + 2 + size])
                del buf[:eol + 4 + size]
                return data
        if not _fill(buf, receive, RECEIVE_SIZE):
            raise AnswerError(Fault.CUT, "connection closed inside a chunk")


def _fill(buf: bytearray, receive: Receive, want: int) -> bool:
    """More bytes into ``buf``; False once the peer closed."""
    data = receive(want)
    buf += data
    return bool(data)
