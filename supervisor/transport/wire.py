"""The client's one I/O stack: HTTP/1.1 over a blocking socket, one request per connection, with no
HTTP library in the way. A file body is sent by the kernel (``socket.sendfile``: zero-copy on a plain
socket) and received with ``recv_into`` into large buffers that a second thread hashes and writes
while the next one fills; a JSON request and its answer are small and go through the same calls.

Why not aiohttp (or another client library): at loopback and LAN speeds its client spends more CPU
per GB passing 64-256 KiB chunks through its parser, queues and executor hops than the kernel spends
moving the bytes (BENCHMARKS.md, issue 17), and carrying two stacks (one for JSON, one for bodies)
doubled the deadline and retry code (issue 29). The peer is our own server, so the subset spoken here
is small: a status line, headers, and a body of exactly ``Content-Length`` bytes (chunked answers are
refused), read by the one HTTP/1.1 reader (:mod:`supervisor.transport.http11`) under this client's limits.

Everything here blocks the calling thread. Two clocks bound an exchange: ``stall`` (each socket
operation's timeout: the longest it may make no progress) and the overall :class:`Deadline` (base
seconds plus size at a minimum throughput, not counting waits for our own bandwidth limiter), which a
peer trickling a byte now and then cannot escape.
"""

from __future__ import annotations

import os
import queue
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from rlsup_format.digest import new_hasher
from rlsup_format.fileio import start_writeback
from supervisor.transport import http11
from supervisor.transport.limits import BandwidthLimiter

#: Largest response head accepted (status line and headers).
MAX_HEAD = 64 * 1024
#: Receive buffer: two of them per transfer (one filling, one being hashed and written).
RECV_BUFFER = 8 << 20
#: Bytes handed to one ``sendfile`` call when no bandwidth limit applies.
SEND_SEGMENT = 64 << 20


class WireError(Exception):
    """The exchange broke (closed connection, truncated or malformed answer): ``retryable`` by default."""

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class DeadlineExpired(Exception):
    """The overall deadline passed (never retried: a peer this slow is better replaced)."""


@dataclass
class Deadline:
    """The overall deadline of one attempt: ``base`` + ``size / rate`` seconds (``rate <= 0``: none),
    moved by the time spent waiting for our own bandwidth limiter."""

    base: float
    rate: float
    size: int = 0
    start: float = field(default_factory=time.monotonic)
    waited: float = 0.0
    done: int = 0  # bytes moved so far, for the error message

    def when(self) -> float | None:
        return None if self.rate <= 0 else self.start + self.base + self.waited + self.size / self.rate

    @property
    def seconds(self) -> float:
        when = self.when()
        return float("inf") if when is None else when - self.start

    def sized(self, size: int) -> None:
        self.size = max(self.size, size)

    def left(self) -> float | None:
        when = self.when()
        return None if when is None else when - time.monotonic()

    def throttle(self, limiter: BandwidthLimiter | None, n: int) -> None:
        """Count ``n`` bytes and wait for the limiter's grant (the wait moves the deadline)."""
        self.done += n
        if limiter is None:
            return
        wait = limiter.reserve(n)
        if wait > 0:
            self.waited += wait
            time.sleep(wait)


def settle(sock: socket.socket, stall: float, deadline: Deadline) -> None:
    """Set the socket's timeout for its next operation: ``stall``, or less when the deadline is closer."""
    left = deadline.left()
    if left is not None and left <= 0:
        raise DeadlineExpired()
    sock.settimeout(stall if left is None else max(0.001, min(stall, left)))


def on_timeout(deadline: Deadline) -> BaseException:
    """What a socket timeout means: the deadline, when it has passed, else a (retryable) stall."""
    left = deadline.left()
    return DeadlineExpired() if left is not None and left <= 0 else TimeoutError("no progress (stalled)")


def connect(endpoint: str, ssl_context: ssl.SSLContext | None, timeout: float) -> socket.socket:
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")  # an IPv6 literal as endpoints write it
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ssl_context is not None:
            sock = ssl_context.wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise
    return sock


def send_head(sock: socket.socket, method: str, path: str, endpoint: str, headers: dict[str, str],
              stall: float, deadline: Deadline, body: bytes = b"") -> None:
    """The request head, and ``body`` (a small one: a JSON request) in the same write."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {endpoint}", "Connection: close",
             *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    settle(sock, stall, deadline)
    try:
        sock.sendall("\r\n".join(lines).encode("latin-1") + body)
    except TimeoutError:
        raise on_timeout(deadline) from None


@dataclass
class Answer:
    """A response head; ``rest``: body bytes that arrived with it."""

    status: int
    headers: dict[str, str]  # names lower-cased
    rest: bytes

    def length(self) -> int:
        """The declared body length (a chunked answer, or one without a valid Content-Length, is refused)."""
        try:
            return http11.content_length(self.headers)
        except http11.AnswerError as e:
            raise refused(e) from None


def refused(error: http11.AnswerError) -> WireError:
    """The reader's refusal as this client's error: an answer cut short, or one that does not parse (the
    network's garbling, maybe), is worth another try; one over a limit or without a length breaks the
    protocol, and the peer is not asked again."""
    retryable = error.fault in (http11.Fault.CUT, http11.Fault.GARBLED)
    return WireError(str(error), retryable=retryable)


def _receiver(sock: socket.socket, stall: float, deadline: Deadline) -> http11.Receive:
    """The reader's source: ``recv`` under the stall timeout and the overall deadline."""
    def receive(want: int) -> bytes:
        settle(sock, stall, deadline)
        try:
            return sock.recv(want)
        except TimeoutError:
            raise on_timeout(deadline) from None
    return receive


def read_head(sock: socket.socket, stall: float, deadline: Deadline, pending: bytes = b"") -> Answer:
    """Read one response head (``pending``: bytes already read after the previous one)."""
    buf = bytearray(pending)
    try:
        status, headers = http11.read_head(buf, _receiver(sock, stall, deadline), MAX_HEAD)
    except http11.AnswerError as e:
        raise refused(e) from None
    return Answer(status, headers, bytes(buf))


def read_small_body(sock: socket.socket, answer: Answer, cap: int, stall: float, deadline: Deadline) -> bytes:
    """The whole (small: at most ``cap`` bytes) body of ``answer``."""
    try:
        n = http11.content_length(answer.headers, cap)
        return http11.read_body(bytearray(answer.rest), _receiver(sock, stall, deadline), n)
    except http11.AnswerError as e:
        raise refused(e) from None


class _HashingFileWriter(threading.Thread):
    """Hashes and writes the buffers the receiving thread hands over, in order, while it fills the next."""

    def __init__(self, fd: int, hasher: Any = None, start_disk: bool = False) -> None:
        super().__init__(name="rlsup-wire-writer", daemon=True)
        self.fd = fd
        self.start_disk = start_disk
        self.hash = hasher if hasher is not None else new_hasher()
        self.full: queue.Queue[tuple[bytearray, int] | None] = queue.Queue()
        self.free: queue.Queue[bytearray] = queue.Queue()
        for _ in range(2):
            self.free.put(bytearray(RECV_BUFFER))
        self.error: BaseException | None = None
        self.written = 0

    def run(self) -> None:
        while (item := self.full.get()) is not None:
            buf, n = item
            try:
                if self.error is None:
                    view = memoryview(buf)[:n]
                    self.hash.update(view)
                    while view:
                        view = view[os.write(self.fd, view):]
                    if self.start_disk:  # the disk works while the next buffer fills
                        start_writeback(self.fd, self.written, n)
                    self.written += n
            except BaseException as e:  # noqa: BLE001 - handed to the receiving thread
                self.error = e
            finally:
                self.free.put(buf)

    def finish(self) -> str:
        self.full.put(None)
        self.join()
        if self.error is not None:
            raise self.error
        return self.hash.hexdigest()


def receive_to_fd(sock: socket.socket, first: bytes, fd: int, length: int, stall: float, deadline: Deadline,
                  limiter: BandwidthLimiter | None = None, hasher: Any = None, start_disk: bool = False) -> str:
    """Receive exactly ``length`` body bytes (``first``: those that came with the head) into ``fd``,
    hashed as they pass (into ``hasher`` when given, else a new one); returns the hex digest. A
    shorter or longer body is a :class:`WireError`. ``start_disk``: start writing each buffer to disk
    at once (a restore, whose fsync then waits for the tail only; that writeback is then done, and
    its CPU counted, in this process instead of the kernel's flusher threads)."""
    if len(first) > length:
        raise WireError("body longer than Content-Length")
    writer = _HashingFileWriter(fd, hasher, start_disk)
    writer.start()
    try:
        got = 0
        while got < length:
            buf = writer.free.get()
            if writer.error is not None:
                break
            view = memoryview(buf)
            filled = 0
            if got == 0 and first:
                view[:len(first)] = first
                filled = len(first)
                deadline.throttle(limiter, filled)
            want = min(len(buf), length - got)
            while filled < want:
                filled += _recv_some(sock, view[filled:want], stall, deadline, limiter, got + filled, length)
            got += filled
            writer.full.put((buf, filled))
    finally:
        digest = writer.finish()
    return digest


def _recv_some(sock: socket.socket, view: memoryview, stall: float, deadline: Deadline,
               limiter: BandwidthLimiter | None, got: int, length: int) -> int:
    settle(sock, stall, deadline)
    try:
        n = sock.recv_into(view)
    except TimeoutError:
        raise on_timeout(deadline) from None
    if not n:
        raise WireError(f"body truncated at {got} of {length} bytes")
    deadline.throttle(limiter, n)
    return n


def send_file(sock: socket.socket, f: BinaryIO, size: int, stall: float, deadline: Deadline,
              limiter: BandwidthLimiter | None = None, segment: int = 1 << 20) -> None:
    """Send exactly ``size`` bytes of ``f`` from its start (``sendfile``: the kernel copies page cache to
    socket). Segments of ``segment`` bytes under a bandwidth limit, else large ones; a file that ends
    early is a non-retryable :class:`WireError`."""
    step = segment if limiter is not None and not limiter.unlimited else SEND_SEGMENT
    plain = not isinstance(sock, ssl.SSLSocket)
    offset = 0
    while offset < size:
        n = min(step, size - offset)
        deadline.throttle(limiter, n)
        settle(sock, stall, deadline)
        try:
            sent = _sendfile_plain(sock, f, offset, n, stall, deadline) if plain else sock.sendfile(f, offset, n)
        except TimeoutError:
            raise on_timeout(deadline) from None
        if sent < n:
            raise WireError(f"file shrank while being sent (ended at {offset + sent} of {size} bytes)",
                            retryable=False)
        offset += sent


def _sendfile_plain(sock: socket.socket, f: BinaryIO, offset: int, n: int, stall: float, deadline: Deadline) -> int:
    """``os.sendfile`` until ``n`` bytes are sent or the file ends; each wait for room in the socket is
    bounded by the stall timeout and the overall deadline (a receiver that takes a few bytes now and
    then cannot hold a segment open past the deadline). Returns the bytes sent."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    sent = 0
    while sent < n:
        left = deadline.left()
        if left is not None and left <= 0:
            raise DeadlineExpired()
        wait = stall if left is None else min(stall, left)
        if not poller.poll(max(1, int(wait * 1000))):
            raise on_timeout(deadline)
        try:
            k = os.sendfile(sock.fileno(), f.fileno(), offset + sent, n - sent)
        except BlockingIOError:
            continue
        if k == 0:
            break  # the file ended
        sent += k
    return sent
