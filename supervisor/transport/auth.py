"""Shared-secret request authentication for the replication transport.

Every node of a job reads the same secret from ``token_file`` (:func:`load_secret`): at least 16
bytes, surrounding whitespace stripped, in a file that only its owner can read (``chmod 600``; a
group- or world-accessible file is refused, like ssh refuses a readable private key).

Each HTTP request carries three headers::

    X-Rlsup-Timestamp: <unix seconds, decimal>
    X-Rlsup-Nonce:     <16..64 chars of [A-Za-z0-9_-], random per request>
    Authorization:     RLSUP-HMAC-SHA256 <64 lowercase hex digits>

where the hex is ``HMAC-SHA256(secret, canonical)`` and ``canonical`` is the UTF-8 of::

    METHOD \\n PATH \\n TIMESTAMP \\n NONCE \\n CONTENT-LENGTH-or-empty \\n DECLARED-XXH3-or-empty

``PATH`` is the request target exactly as sent on the request line (percent-encoding untouched,
query string included); ``CONTENT-LENGTH`` is the ``Content-Length`` header (empty when absent);
``DECLARED-XXH3`` is the ``X-Rlsup-Xxh3`` header (empty when absent). The body itself is not in the
MAC: its length and its xxh3-128 are, and the server refuses a body that does not match the declared
checksum, so a body cannot be altered without breaking either the checksum or the signature.

The server compares in constant time (:func:`hmac.compare_digest`), refuses a timestamp more than
300 s away from its own clock, and remembers the nonces of accepted requests (bounded, 65536 by default;
when full, the entry with the oldest timestamp is evicted and raises a floor at or below which
timestamps are refused, so eviction never reopens a replay window). Missing or malformed credentials are answered 401, a wrong signature, a stale timestamp or
a replayed nonce 403. Nonces are recorded only after the signature verified, so unauthenticated
traffic cannot flush the cache. There is no encryption unless the server and clients are given an
``ssl.SSLContext`` (TLS); without it the secret never travels, but the data does, in clear.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import os
import re
import secrets
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rlsup_format.digest import new_hasher

SCHEME = "RLSUP-HMAC-SHA256"
H_TIMESTAMP = "X-Rlsup-Timestamp"
H_NONCE = "X-Rlsup-Nonce"
H_XXH3 = "X-Rlsup-Xxh3"
H_AUTH = "Authorization"
MAX_SKEW_S = 300
MIN_SECRET_BYTES = 16
_NONCE_RE = re.compile(r"^[A-Za-z0-9_-]{16,64}$")
_TS_RE = re.compile(r"^[0-9]{1,12}$")
_SIG_RE = re.compile(r"^[0-9a-f]{64}$")


class SecretError(ValueError):
    """The token file is missing, unreadable, empty, too short or too widely readable."""


def load_secret(path: str | os.PathLike) -> bytes:
    """Read the shared secret from ``path``; every error names the file and says what to do."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise SecretError(f"token_file {p}: does not exist (create it with: "
                          f"python -c 'import secrets; print(secrets.token_hex(32))' > {p}; chmod 600 {p})") from None
    except OSError as e:
        raise SecretError(f"token_file {p}: cannot stat: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SecretError(f"token_file {p}: not a regular file")
    if st.st_mode & 0o077:
        raise SecretError(f"token_file {p}: permissions {stat.S_IMODE(st.st_mode):04o} let other users "
                          f"read or change the secret; run: chmod 600 {p}")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise SecretError(f"token_file {p}: cannot read: {e.strerror or e}") from None
    secret = data.strip()
    if not secret:
        raise SecretError(f"token_file {p}: is empty")
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"token_file {p}: secret is {len(secret)} bytes, at least {MIN_SECRET_BYTES} needed "
                          f"(e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    return secret


def write_secret(path: str | os.PathLike) -> bytes:
    """Create ``path`` (mode 0600) holding a fresh random secret; returns the secret as load_secret would."""
    p = Path(path)
    token = secrets.token_hex(32).encode()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(token + b"\n")
    return token


def body_digest(data: bytes | bytearray) -> str:
    """The xxh3-128 (the format's digest) a request or answer declares in ``X-Rlsup-Xxh3`` for ``data``."""
    h = new_hasher()
    h.update(data)
    return h.hexdigest()


def canonical(method: str, path: str, timestamp: str, nonce: str, content_length: str, xxh3: str) -> bytes:
    return "\n".join((method.upper(), path, timestamp, nonce, content_length, xxh3)).encode("utf-8")


def sign(secret: bytes, method: str, path: str, timestamp: str, nonce: str,
         content_length: str = "", xxh3: str = "") -> str:
    return hmac.new(secret, canonical(method, path, timestamp, nonce, content_length, xxh3),
                    hashlib.sha256).hexdigest()


def auth_headers(secret: bytes, method: str, path: str, content_length: int | None = None,
                 xxh3: str | None = None, now: float | None = None, nonce: str | None = None) -> dict[str, str]:
    """The headers a client adds to one request (``Content-Length``/``X-Rlsup-Xxh3`` included when given)."""
    ts = str(int(time.time() if now is None else now))
    nonce = nonce or secrets.token_urlsafe(18)
    cl = "" if content_length is None else str(int(content_length))
    x = xxh3 or ""
    headers = {H_TIMESTAMP: ts, H_NONCE: nonce, H_AUTH: f"{SCHEME} {sign(secret, method, path, ts, nonce, cl, x)}"}
    if content_length is not None:
        headers["Content-Length"] = cl
    if xxh3:
        headers[H_XXH3] = x
    return headers


@dataclass
class AuthResult:
    status: int  # 200 ok, 401 missing/malformed, 403 wrong
    reason: str

    @property
    def ok(self) -> bool:
        return self.status == 200


class Verifier:
    """Server side: checks signature, clock skew and replays. Thread-safe."""

    def __init__(self, secret: bytes, max_skew_s: int = MAX_SKEW_S, max_nonces: int = 65536) -> None:
        if not secret:
            raise ValueError("empty secret")
        self._secret = bytes(secret)
        self._skew = max_skew_s
        self._max = max_nonces
        self._nonces: dict[str, int] = {}
        self._heap: list[tuple[int, str]] = []
        self._floor = -1  # timestamps <= floor are refused: their nonces may have been evicted
        self._lock = threading.Lock()

    def verify(self, method: str, path: str, headers, now: float | None = None) -> AuthResult:
        """``headers``: a case-insensitive mapping (aiohttp's CIMultiDict, or a dict with exact names)."""
        auth = headers.get(H_AUTH)
        ts = headers.get(H_TIMESTAMP)
        nonce = headers.get(H_NONCE)
        if not auth or ts is None or nonce is None:
            return AuthResult(401, "missing credentials (Authorization, X-Rlsup-Timestamp, X-Rlsup-Nonce)")
        scheme, _, sig = auth.partition(" ")
        sig = sig.strip()
        if scheme != SCHEME or not _SIG_RE.match(sig):
            return AuthResult(401, f"malformed Authorization header (expected '{SCHEME} <64 hex>')")
        if not _TS_RE.match(ts):
            return AuthResult(401, "malformed X-Rlsup-Timestamp")
        if not _NONCE_RE.match(nonce):
            return AuthResult(401, "malformed X-Rlsup-Nonce")
        expected = sign(self._secret, method, path, ts, nonce,
                        headers.get("Content-Length") or "", headers.get(H_XXH3) or "")
        if not hmac.compare_digest(expected, sig):
            return AuthResult(403, "bad signature")
        t = int(ts)
        now_s = time.time() if now is None else now
        if abs(now_s - t) > self._skew:
            return AuthResult(403, f"timestamp {t} is more than {self._skew}s from server time {int(now_s)} "
                                   f"(check the clocks)")
        with self._lock:
            # Forget nonces too old to be accepted anyway (their timestamps fail the skew check).
            while self._heap and self._heap[0][0] < now_s - self._skew - 1:
                _, old = heapq.heappop(self._heap)
                self._nonces.pop(old, None)
            if nonce in self._nonces:
                return AuthResult(403, "replayed nonce")
            if t <= self._floor:
                return AuthResult(403, "timestamp at or below the replay-cache floor (over "
                                       f"{self._max} requests within the skew window); retry")
            self._nonces[nonce] = t
            heapq.heappush(self._heap, (t, nonce))
            while len(self._nonces) > self._max:  # evict the oldest timestamp, raise the floor to it
                evicted_t, old = heapq.heappop(self._heap)
                self._nonces.pop(old, None)
                self._floor = max(self._floor, evicted_t)
        return AuthResult(200, "ok")
