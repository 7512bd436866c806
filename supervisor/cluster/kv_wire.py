"""The embedded coordination store's wire: authenticated frames over one TCP connection.

rlsup's own protocol rather than torch's ``TCPStore``, for two reasons: a node's supervisor then never imports
torch (1.3 s of CPU and ~300 MB of address space per node process, for a dict on node 0), and the channel is
authenticated with the job's shared secret like the replication transport (TCPStore lets anyone who reaches
the port read, delete or count keys; the values were signed, the store was not).

A connection opens with a handshake: the server says hello (``MAGIC``, a fresh nonce, and the job it serves,
so a node of another job can name it), the client answers with its own nonce and
``HMAC(secret, "client" | server nonce | client nonce)``, and the server proves the secret back with
``HMAC(secret, "server" | ...)`` or refuses (a frame saying why, then it closes). Every later frame carries
``HMAC(session key, direction | sequence number | body)``, the session key derived from both nonces: a frame
altered, replayed or injected ends the connection. There is no encryption (the values are the job's
coordination records, signed on their own: :mod:`supervisor.cluster.signed_keys`).

A frame is a 4-byte big-endian length, the body, then (after the handshake) the 32-byte tag; a body is a
2-byte count of fields, each a 4-byte length and its bytes. Frames over :data:`MAX_FRAME_BYTES` (handshake
frames over :data:`MAX_HELLO_BYTES`) are refused before they are read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import time
from typing import Sequence

MAGIC = b"rlsup-kv/1"
NONCE_BYTES = 16
TAG_BYTES = 32
MAX_FRAME_BYTES = 256 * 1024 * 1024  # one request or answer (a hang's Flight Recorder dumps are the largest values)
MAX_HELLO_BYTES = 4096
MAX_FIELDS = 65535
_LEN = struct.Struct(">I")
_COUNT = struct.Struct(">H")
TO_SERVER, TO_CLIENT = b"c", b"s"


class WireError(ConnectionError):
    """The peer broke the protocol (a bad tag, a malformed or oversized frame) or closed the connection."""


class Refused(ConnectionError):
    """The store refused this node's secret; ``serves`` is the job it says it serves (for the message)."""

    def __init__(self, message: str, serves: str) -> None:
        super().__init__(message)
        self.serves = serves


def encode(fields: Sequence[bytes]) -> bytes:
    if len(fields) > MAX_FIELDS:
        raise ValueError(f"{len(fields)} fields in one frame (at most {MAX_FIELDS})")
    return _COUNT.pack(len(fields)) + b"".join(_LEN.pack(len(f)) + bytes(f) for f in fields)


def decode(body: bytes) -> list[bytes]:
    if len(body) < _COUNT.size:
        raise WireError("a frame without its field count")
    (count,), at, out = _COUNT.unpack_from(body), _COUNT.size, []
    for _ in range(count):
        if at + _LEN.size > len(body):
            raise WireError("a frame cut short")
        (n,) = _LEN.unpack_from(body, at)
        at += _LEN.size
        if at + n > len(body):
            raise WireError("a frame cut short")
        out.append(body[at:at + n])
        at += n
    if at != len(body):
        raise WireError("a frame with bytes after its fields")
    return out


def _until(sock: socket.socket, deadline: float | None) -> None:
    """The socket's timeout set to what is left before ``deadline`` (a whole exchange's, not one call's)."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        sock.settimeout(left)


def _read_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    chunks, left = [], n
    while left:
        _until(sock, deadline)
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise WireError("the connection was closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_plain(sock: socket.socket, limit: int = MAX_HELLO_BYTES, deadline: float | None = None) -> list[bytes]:
    """One handshake frame (no tag), whole before ``deadline``."""
    (n,) = _LEN.unpack(_read_exact(sock, _LEN.size, deadline))
    if n > limit:
        raise WireError(f"a handshake frame of {n} bytes (at most {limit})")
    return decode(_read_exact(sock, n, deadline))


def send_plain(sock: socket.socket, fields: Sequence[bytes], deadline: float | None = None) -> None:
    body = encode(fields)
    _until(sock, deadline)
    sock.sendall(_LEN.pack(len(body)) + body)


def _mac(secret: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, label + server_nonce + client_nonce, hashlib.sha256).digest()


class Session:
    """One authenticated connection's framing: tags out, checks in, a sequence number each way."""

    def __init__(self, sock: socket.socket, key: bytes, outgoing: bytes) -> None:
        self.sock, self._key = sock, key
        self._out, self._in = outgoing, TO_CLIENT if outgoing == TO_SERVER else TO_SERVER
        self._sent = self._received = 0

    def _tag(self, direction: bytes, seq: int, body: bytes) -> bytes:
        return hmac.new(self._key, direction + seq.to_bytes(8, "big") + body, hashlib.sha256).digest()

    def send(self, fields: Sequence[bytes], deadline: float | None = None) -> None:
        """One frame; :class:`ValueError` (nothing sent) when it is over :data:`MAX_FRAME_BYTES`."""
        body = encode(fields)
        if len(body) > MAX_FRAME_BYTES:
            raise ValueError(f"a frame of {len(body)} bytes (at most {MAX_FRAME_BYTES})")
        _until(self.sock, deadline)
        self.sock.sendall(_LEN.pack(len(body)) + body + self._tag(self._out, self._sent, body))
        self._sent += 1

    def receive(self, deadline: float | None = None) -> list[bytes]:
        """One frame, whole before ``deadline`` (None: the socket's own timeout per read)."""
        (n,) = _LEN.unpack(_read_exact(self.sock, _LEN.size, deadline))
        if n > MAX_FRAME_BYTES:
            raise WireError(f"a frame of {n} bytes (at most {MAX_FRAME_BYTES})")
        body = _read_exact(self.sock, n, deadline)
        if not hmac.compare_digest(_read_exact(self.sock, TAG_BYTES, deadline),
                                   self._tag(self._in, self._received, body)):
            raise WireError("a frame whose tag does not verify (altered, replayed or not from the peer)")
        self._received += 1
        return decode(body)


def server_handshake(sock: socket.socket, secret: bytes, serves: dict, deadline: float) -> Session:
    """The server's side, whole before ``deadline``: hello, check the client's proof (:class:`WireError` when it
    fails, after telling the client), prove the secret back."""
    server_nonce = os.urandom(NONCE_BYTES)
    send_plain(sock, [MAGIC, server_nonce, json.dumps(serves).encode()], deadline)
    fields = read_plain(sock, deadline=deadline)
    if len(fields) != 2 or len(fields[0]) != NONCE_BYTES:
        raise WireError("a malformed handshake")
    client_nonce, proof = fields
    if not hmac.compare_digest(proof, _mac(secret, b"client", server_nonce, client_nonce)):
        send_plain(sock, [b"refused", b"this store's job signs with another secret"], deadline)
        raise WireError("a client without this job's secret")
    send_plain(sock, [b"ok", _mac(secret, b"server", server_nonce, client_nonce)], deadline)
    return Session(sock, _mac(secret, b"session", server_nonce, client_nonce), TO_CLIENT)


def client_handshake(sock: socket.socket, secret: bytes, deadline: float | None = None) -> Session:
    """The client's side, whole before ``deadline``; :class:`Refused` (naming the job the store serves) when the
    store does not take this secret, :class:`WireError` when the other end is not an rlsup store or cannot prove
    the secret."""
    hello = read_plain(sock, deadline=deadline)
    if len(hello) != 3 or hello[0] != MAGIC or len(hello[1]) != NONCE_BYTES:
        raise WireError("the other end is not an rlsup coordination store")
    server_nonce, serves = hello[1], _serves(hello[2])
    client_nonce = os.urandom(NONCE_BYTES)
    send_plain(sock, [client_nonce, _mac(secret, b"client", server_nonce, client_nonce)], deadline)
    answer = read_plain(sock, deadline=deadline)
    if answer[:1] == [b"refused"]:
        raise Refused(f"the store serves {serves} and refused this node's secret", serves)
    if len(answer) != 2 or answer[0] != b"ok" or not hmac.compare_digest(
            answer[1], _mac(secret, b"server", server_nonce, client_nonce)):
        raise WireError("the store could not prove the job's secret")
    return Session(sock, _mac(secret, b"session", server_nonce, client_nonce), TO_SERVER)


def _serves(raw: bytes) -> str:
    """The job a store's hello names, for messages only (it is not authenticated)."""
    try:
        d = json.loads(raw)
        return f"rlsup job {str(d['job'])[:64]!r} ({str(d['source'])[:200]})"
    except (ValueError, KeyError, TypeError):
        return "an rlsup job (its hello does not parse)"
