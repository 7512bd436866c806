"""The one HTTP/1.1 answer reader (supervisor.transport.http11) on scripted bytes, no socket: an answer is read
whole and what follows it stays for the next one; oversized, malformed or cut answers are refused with an error
naming what was wrong and its fault; a source's timeout passes through and leaves the bytes for the next try;
and the transport retries a cut or garbled answer only. The clients' own tests over real sockets, with how
each names these refusals: tests/cluster/test_gateway_client.py (etcd) and tests/transport/test_transport_http_e2e.py (transport)."""

from __future__ import annotations

import pytest

from supervisor.transport import http11, wire
from supervisor.transport.http11 import AnswerError, Fault


class Script:
    """A ``receive`` that hands out ``parts`` in order (an exception instance is raised instead), then b""
    (the peer closed); records what each call asked for."""

    def __init__(self, *parts: bytes | BaseException) -> None:
        self.parts = list(parts)
        self.asked: list[int] = []

    def __call__(self, want: int) -> bytes:
        self.asked.append(want)
        if not self.parts:
            return b""
        part = self.parts.pop(0)
        if isinstance(part, BaseException):
            raise part
        return part


def _refusal(call, *args) -> AnswerError:
    with pytest.raises(AnswerError) as caught:
        call(*args)
    return caught.value


def test_a_head_and_its_body_are_read_and_what_follows_stays() -> None:
    buf = bytearray()
    receive = Script(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Name:  v \r\n", b"\r\nhel", b"lo", b"HTTP/1.1 ")
    status, headers = http11.read_head(buf, receive, 1024)
    assert (status, headers) == (200, {"content-length": "5", "x-name": "v"})
    assert http11.read_body(buf, receive, http11.content_length(headers, 5)) == b"hello"
    assert receive.asked[-1] == 2  # asked no more than the body still lacked
    assert buf == b""
    buf += b"HTTP/1.1 204 No Content\r\n\r\nnext"
    assert http11.read_head(buf, Script(), 1024) == (204, {})
    assert buf == b"next"  # a kept-alive connection's next bytes are not lost


@pytest.mark.parametrize("parts", [
    [b"HTTP/1.1 200 OK\r\nX-Junk: " + b"j" * 100],  # never ends
    [b"HTTP/1.1 200 OK\r\nX-Junk: " + b"j" * 100 + b"\r\n\r\n"],  # ends, but past the limit
], ids=["unterminated", "whole-but-too-long"])
def test_a_head_over_the_limit_is_refused(parts: list[bytes]) -> None:
    error = _refusal(http11.read_head, bytearray(), Script(*parts), 64)
    assert error.fault is Fault.OVER_LIMIT and "status line and headers over 64 bytes" in str(error)


@pytest.mark.parametrize("head, says", [
    (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "malformed status line (not HTTP/1.x): 'SSH-2.0-OpenSSH_9.2'"),
    (b"HTTP/1.1 2x0 OK\r\n\r\n", "malformed status line"),
    (b"HTTP/1.1 \xb2\xb2\xb2 OK\r\n\r\n", "malformed status line"),  # digits to isdigit(), not to int()
    (b"HTTP/1.1 200 OK\r\nContent-Type\r\n\r\n", "malformed header line (no colon): 'Content-Type'"),
])
def test_a_head_that_does_not_parse_is_garbled(head: bytes, says: str) -> None:
    error = _refusal(http11.read_head, bytearray(head), Script(), 1024)
    assert error.fault is Fault.GARBLED and says in str(error)


def test_a_head_cut_short_says_so() -> None:
    error = _refusal(http11.read_head, bytearray(), Script(b"HTTP/1.1 200 OK\r\n"), 1024)
    assert error.fault is Fault.CUT and "connection closed before a complete answer head" in str(error)


@pytest.mark.parametrize("headers, says", [
    ({}, "answer lacks a valid Content-Length (got '')"),
    ({"content-length": "12a"}, "answer lacks a valid Content-Length (got '12a')"),
    ({"content-length": "-1"}, "answer lacks a valid Content-Length"),
    ({"content-length": "\xb2"}, "answer lacks a valid Content-Length"),  # a latin-1 superscript two
    ({"transfer-encoding": "chunked", "content-length": "2"}, "chunked answer (a Content-Length is required)"),
])
def test_a_body_without_a_valid_length_is_refused(headers: dict[str, str], says: str) -> None:
    error = _refusal(http11.content_length, headers)
    assert error.fault is Fault.NO_LENGTH and says in str(error)


def test_a_body_over_the_limit_is_refused_before_it_is_read() -> None:
    assert http11.content_length({"content-length": "100"}, 100) == 100
    assert http11.content_length({"content-length": str(1 << 40)}) == 1 << 40  # no limit given
    error = _refusal(http11.content_length, {"content-length": "101"}, 100)
    assert error.fault is Fault.OVER_LIMIT and "answer body of 101 bytes exceeds the limit of 100" in str(error)


def test_a_truncated_body_says_how_much_came() -> None:
    error = _refusal(http11.read_body, bytearray(b"abc"), Script(b"de"), 10)
    assert error.fault is Fault.CUT and "answer truncated at 5 of 10 bytes" in str(error)


def test_chunks_are_read_in_order_and_the_last_is_empty() -> None:
    buf = bytearray()
    receive = Script(b"5;ext=1\r\nhel", b"lo\r\n0\r\n\r\n")
    assert http11.read_chunk(buf, receive, 5) == b"hello"
    assert http11.read_chunk(buf, receive, 5) == b""
    assert buf == b""


def test_a_timeout_mid_chunk_passes_through_and_loses_nothing() -> None:
    buf = bytearray()
    receive = Script(b"5\r\nhe", TimeoutError("no answer in time"), b"llo\r\n")
    with pytest.raises(TimeoutError):
        http11.read_chunk(buf, receive, 100)
    assert buf == b"5\r\nhe"  # nothing taken: the next call starts over on the same bytes
    assert http11.read_chunk(buf, receive, 100) == b"hello"


@pytest.mark.parametrize("data, fault, says", [
    (b"zz\r\n", Fault.GARBLED, "a chunk size that does not parse: b'zz'"),
    (b"-1\r\n\r\n", Fault.GARBLED, "a chunk size that does not parse: b'-1'"),
    (b"0x5\r\nhello\r\n", Fault.GARBLED, "a chunk size that does not parse"),
    (b"a\r\n" + b"x" * 10 + b"junk", Fault.GARBLED, "a chunk not followed by CRLF"),
    (b"1" * 40, Fault.GARBLED, "a chunk size line over 32 bytes"),
    (b"1;" + b"e" * 40 + b"\r\nx\r\n", Fault.GARBLED, "a chunk size line over 32 bytes"),
    (b"65\r\n", Fault.OVER_LIMIT, "a chunk of 101 bytes, over the limit of 100"),
    (b"5\r\nhe", Fault.CUT, "connection closed inside a chunk"),
], ids=["not-hex", "negative", "0x", "no-crlf", "endless-size-line", "long-extension", "over-limit", "cut"])
def test_a_chunk_that_breaks_the_framing_is_refused(data: bytes, fault: Fault, says: str) -> None:
    error = _refusal(http11.read_chunk, bytearray(data), Script(), 100)
    assert error.fault is fault and says in str(error)


@pytest.mark.parametrize("fault, retryable", [
    (Fault.CUT, True), (Fault.GARBLED, True), (Fault.NO_LENGTH, False), (Fault.OVER_LIMIT, False),
])
def test_the_transport_retries_a_cut_or_garbled_answer_only(fault: Fault, retryable: bool) -> None:
    error = wire.refused(AnswerError(fault, "what was wrong"))
    assert (str(error), error.retryable) == ("what was wrong", retryable)
