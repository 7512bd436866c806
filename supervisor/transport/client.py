"""Talking to a peer's :class:`~supervisor.transport.server.ReplicationServer`: a synchronous API
usable from any thread.

One I/O stack: every request (JSON calls and file bodies alike) is one HTTP/1.1 exchange on its own
blocking connection in the calling thread (:mod:`supervisor.transport.wire`), so many threads can
transfer at once and nothing is held between calls (no event loop, no pool, nothing to redo after a
``fork``). Every request is signed (:mod:`supervisor.transport.auth`). Memory per transfer is bounded
(two 8 MiB receive buffers; a JSON answer at most :data:`MAX_JSON_ANSWER` bytes).

Retries (:meth:`PeerClient._with_retries`, the one retry loop): connection errors, stalls, a
truncated or corrupted answer and 5xx answers are retried ``retries`` times with exponential backoff
(``backoff * 2**i``, +-20% jitter so clients that failed together do not retry together); 4xx answers
(the request itself is wrong), an answer that breaks the protocol (malformed JSON, oversized, chunked)
and a missed overall deadline are not. ``timeout`` is the connect timeout and the longest an exchange
may stall (no bytes either way). Every failure is a :class:`TransportError` naming the peer.

Overall deadlines (:class:`supervisor.transport.wire.Deadline`, the one deadline type): a peer that
trickles bytes (one every few seconds) never stalls long enough for ``timeout`` to fire, so every
attempt also has an overall deadline of ``deadline_base`` seconds plus ``size / min_throughput`` (the
size is the file's for a transfer, the answer's declared length for an index or other JSON call), not
counting time spent waiting for our own bandwidth limiter. A request that misses it fails at once with
a :class:`TransportError` naming the peer and the file (not retried: a peer that slow is better
replaced by another holder); a fetch removes its temp file. ``min_throughput=0`` turns it off.

Bandwidth: a :class:`BandwidthLimiter` (token bucket, thread-safe) can be shared by all clients of a
process to cap its total replication traffic, both directions; a :class:`TransferPool` bounds how
many file transfers run at once across the clients that share it.
"""

from __future__ import annotations

import errno
import json
import os
import random
import ssl
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence
from urllib.parse import urlencode

from rlsup_format.digest import FileEntry
from rlsup_format.fileio import fsync_dir, open_nofollow
from rlsup_format.names import Kind, reserved_name
from supervisor.transport import wire
from supervisor.transport.limits import BandwidthLimiter, TransferPool  # the client's public API
from supervisor.transport.auth import H_XXH3, auth_headers, body_digest
from supervisor.transport.forward import forward_report
from supervisor.transport.store import validate_namespace, validate_relpath

__all__ = ["BandwidthLimiter", "MAX_JSON_ANSWER", "PeerClient", "TransferPool", "TransportError"]

CHUNK = 1 << 20
#: Largest JSON answer accepted (an index of a namespace with many files stays far below it).
MAX_JSON_ANSWER = 64 << 20
#: Largest error answer read for its message.
_MAX_ERROR_ANSWER = 64 << 10
#: Socket errors that are not ConnectionError but still say "the network or the peer", so retryable.
_NETWORK_ERRNOS = frozenset({errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EHOSTDOWN,
                             errno.ETIMEDOUT, errno.ECONNABORTED, errno.EPIPE})
#: The destination's name in a fetch's temp name is cut to this (a file name has at most 255 bytes).
_LABEL_MAX = 100


class TransportError(Exception):
    """A transfer to or from ``peer`` failed; ``status`` is the HTTP status when the peer answered."""

    def __init__(self, peer: str, message: str, status: int | None = None, retryable: bool = False) -> None:
        super().__init__(f"peer {peer}: {message}")
        self.peer = peer
        self.message = message
        self.status = status
        self.retryable = retryable


def _quote_path(*parts: str) -> str:
    # Validated names only contain [A-Za-z0-9._+=@,~-] and '/', all legal unencoded in a path.
    return "/".join(parts)


class PeerClient:
    def __init__(self, endpoint: str, secret: bytes, timeout: float = 30, retries: int = 3,
                 backoff: float = 0.5, limiter: BandwidthLimiter | None = None,
                 ssl_context: ssl.SSLContext | None = None, pool: TransferPool | None = None,
                 min_throughput: float = 1 << 20, deadline_base: float | None = None) -> None:
        """``min_throughput`` (bytes/s, default 1 MiB/s; 0 = no overall deadline) and ``deadline_base``
        (seconds, default ``max(60, 2 * timeout)``) set each request's overall deadline:
        ``deadline_base + size / min_throughput``."""
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"peer endpoint must be host:port, got {endpoint!r}")
        self.endpoint = endpoint
        self._secret = bytes(secret)
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        if min_throughput is None or min_throughput < 0:
            raise ValueError(f"min_throughput must be >= 0 bytes/s, got {min_throughput!r}")
        self.min_throughput = float(min_throughput)
        self.deadline_base = float(deadline_base) if deadline_base is not None else max(60.0, 2.0 * timeout)
        if not self.deadline_base > 0:
            raise ValueError(f"deadline_base must be > 0 seconds, got {deadline_base!r}")
        self.limiter = limiter
        self.pool = pool
        self.ssl_context = ssl_context

    def __repr__(self) -> str:
        return f"PeerClient({self.endpoint!r})"

    def moved(self, endpoint: str) -> "PeerClient":
        """The same client for a peer at another endpoint (a spare took that node's rank)."""
        return PeerClient(endpoint, self._secret, self.timeout, self.retries, self.backoff, self.limiter,
                          self.ssl_context, self.pool, self.min_throughput, self.deadline_base)

    # ------------------------------------------------------------ plumbing

    def close(self) -> None:
        """Nothing to release (each request has its own connection); kept so callers may close."""

    def __enter__(self) -> "PeerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _err(self, message: str, status: int | None = None, retryable: bool = False) -> TransportError:
        return TransportError(self.endpoint, message, status, retryable)

    def _headers(self, method: str, path: str, content_length: int | None = None,
                 xxh3: str | None = None) -> dict[str, str]:
        return auth_headers(self._secret, method, path, content_length, xxh3)

    @contextmanager
    def _slot(self) -> Iterator[None]:
        if self.pool is None:
            yield
        else:
            with self.pool.slot():
                yield

    def _with_retries(self, what: str, attempt: Callable[[], Any]) -> Any:
        """Run ``attempt`` until it succeeds, raises a final error, or ``retries`` retries are spent
        (the policy is the module docstring's); the last error then names how many attempts were made."""
        last: TransportError | None = None
        for i in range(self.retries + 1):
            if i:
                time.sleep(self.backoff * (2 ** (i - 1)) * random.uniform(0.8, 1.2))
            try:
                return attempt()
            except TransportError as e:
                if not e.retryable:
                    raise
                last = e
        assert last is not None
        raise self._err(f"{last.message} (gave up after {self.retries + 1} attempts)", last.status)

    def _exchange(self, what: str, size: int, body: Callable[[Any, wire.Deadline], Any]) -> Any:
        """One attempt on a fresh connection under an overall deadline; socket trouble becomes a
        retryable :class:`TransportError`, the deadline a final one (local file errors propagate)."""
        dl = wire.Deadline(self.deadline_base, self.min_throughput, size)
        try:
            sock = wire.connect(self.endpoint, self.ssl_context, self.timeout)
        except OSError as e:
            raise self._err(f"{what}: {type(e).__name__}: {e or type(e).__name__}", retryable=True) from None
        try:
            return body(sock, dl)
        except wire.DeadlineExpired:
            raise self._deadline_error(what, dl) from None
        except wire.WireError as e:
            raise self._err(f"{what}: {e}", retryable=e.retryable) from None
        except (ConnectionError, TimeoutError, ssl.SSLError) as e:
            raise self._err(f"{what}: {type(e).__name__}: {e or type(e).__name__}", retryable=True) from None
        except OSError as e:
            if e.errno not in _NETWORK_ERRNOS:
                raise  # a local file's trouble (the destination's disk): not the peer's
            raise self._err(f"{what}: {type(e).__name__}: {e}", retryable=True) from None
        finally:
            sock.close()

    def _deadline_error(self, what: str, dl: wire.Deadline) -> TransportError:
        """The final error of a request that missed its overall deadline."""
        moved = ""
        if dl.done:
            moved = f" with {dl.done} of {dl.size} bytes moved" if dl.size else f" with {dl.done} bytes moved"
        return self._err(f"{what}: overall deadline of {dl.seconds:.1f}s exceeded{moved} "
                         f"(allowed: {dl.base:g}s + size at >= {dl.rate:g} B/s); the peer is too slow or trickling")

    def _answer_status(self, sock: Any, answer: wire.Answer, what: str, dl: wire.Deadline) -> None:
        """Raise the peer's error answer (4xx final, 5xx retryable) with its message."""
        if answer.status < 400:
            return
        detail = ""
        try:
            body = wire.read_small_body(sock, answer, _MAX_ERROR_ANSWER, self.timeout, dl)
            detail = json.loads(body).get("error", "") if body else ""
        except Exception:  # noqa: BLE001 - the status says enough
            pass
        raise self._err(f"{what}: HTTP {answer.status}{': ' + detail if detail else ''}", answer.status,
                        retryable=answer.status >= 500)

    def _request_json(self, method: str, path: str, body: dict | None = None) -> dict:
        """One signed JSON call, retried by the policy: the answer must be a JSON object."""
        data = None if body is None else json.dumps(body).encode()
        what = f"{method} {path}"
        return self._with_retries(what, lambda: self._exchange(
            what, len(data or b""), lambda sock, dl: self._json_once(sock, dl, method, path, data)))

    def _json_once(self, sock: Any, dl: wire.Deadline, method: str, path: str, data: bytes | None) -> dict:
        what = f"{method} {path}"
        if data is not None:
            headers = self._headers(method, path, len(data), body_digest(data))
            headers["Content-Type"] = "application/json"
        elif method in ("GET", "HEAD"):
            headers = self._headers(method, path)
        else:  # a body-less POST/PUT/DELETE says (and signs) an empty body, as HTTP clients do
            headers = self._headers(method, path, 0)
        wire.send_head(sock, method, path, self.endpoint, headers, self.timeout, dl, data or b"")
        answer = wire.read_head(sock, self.timeout, dl)
        self._answer_status(sock, answer, what, dl)
        if method == "HEAD":
            return {}
        dl.sized(answer.length())  # the deadline grows with the declared answer
        raw = wire.read_small_body(sock, answer, MAX_JSON_ANSWER, self.timeout, dl)
        try:
            out = json.loads(raw)
        except ValueError as e:
            raise self._err(f"{what}: invalid JSON answer: {e}") from None
        if not isinstance(out, dict):
            raise self._err(f"{what}: answer is not a JSON object")
        return out

    # ------------------------------------------------------------ API

    def health(self) -> dict:
        return self._request_json("GET", "/v1/health")

    def call_json(self, method: str, path: str, body: dict | None = None) -> dict:
        """Call a route mounted with ``add_json_route``. For GET/DELETE ``body`` becomes the query string."""
        method = method.upper()
        if not path.startswith("/v1/"):
            raise ValueError(f"path must start with /v1/: {path!r}")
        if method in ("GET", "DELETE", "HEAD") and body:
            path = path + "?" + urlencode({str(k): str(v) for k, v in body.items()})
            body = None
        return self._request_json(method, path, body)

    def index(self, namespace: str) -> dict[str, FileEntry]:
        validate_namespace(namespace)
        data = self._request_json("GET", f"/v1/index/{namespace}")
        files = data.get("files")
        if not isinstance(files, dict):
            raise self._err("index: answer has no 'files' object")
        out = {}
        for rel, v in files.items():
            try:
                out[rel] = FileEntry(int(v["size"]), str(v["xxh3_128"]))
            except (KeyError, TypeError, ValueError):
                raise self._err(f"index: malformed entry for {rel!r}") from None
        return out

    def forward_status(self, namespace: str, relpath: str) -> dict[str, str]:
        """What the peer's forwarder says of the last chain of ``namespace/relpath`` through it: per
        endpoint after it, "queued", "ok" (the next hop stored it) or why not; {} when it knows none."""
        validate_namespace(namespace)
        validate_relpath(relpath)
        data = self._request_json("GET", f"/v1/forwards/{_quote_path(namespace, relpath)}")
        got = data.get("forwarded")
        return {str(k): str(v) for k, v in got.items()} if isinstance(got, dict) else {}

    def delete(self, namespace: str, prefix: str) -> int:
        validate_namespace(namespace)
        validate_relpath(prefix)
        data = self._request_json("DELETE", f"/v1/files/{_quote_path(namespace, prefix)}")
        return int(data.get("removed", 0))

    def push_file(self, namespace: str, relpath: str, local_path: str | os.PathLike, entry: FileEntry, *,
                  forward: Sequence[str] = ()) -> dict[str, str]:
        """Upload ``local_path`` as ``namespace/relpath``; the peer stores it only if it matches ``entry``.
        ``forward``: further peers (host:port) the peer streams the file on to as it receives it, in
        order (:mod:`supervisor.transport.forward`). Returns what each of them did: "ok" or why not."""
        validate_namespace(namespace)
        validate_relpath(relpath)
        for ep in forward:
            if not ep or any(c in ep for c in ",?&=%/ "):
                raise ValueError(f"invalid forward endpoint {ep!r}: want host:port")
        path = f"/v1/files/{_quote_path(namespace, relpath)}"
        if forward:
            path += "?forward=" + ",".join(forward)
        what = f"push {namespace}/{relpath}"
        local_path = Path(local_path)
        with self._slot():
            return self._with_retries(what, lambda: self._push_attempt(what, path, local_path, entry, tuple(forward)))

    def _push_attempt(self, what: str, path: str, local_path: Path, entry: FileEntry,
                      forward: tuple[str, ...]) -> dict[str, str]:
        try:
            # A checkpoint file is never a symlink (following one would send whatever it points at),
            # nor a FIFO (it would block): refused, with the reason in strerror.
            f = os.fdopen(open_nofollow(local_path.parent, local_path.name), "rb")
        except OSError as e:
            raise self._err(f"{what}: cannot read {local_path}: {e.strerror or e}") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != entry.size:
                raise self._err(f"{what}: {local_path} has {size} bytes, the entry says {entry.size}")
            answer = self._exchange(what, entry.size, lambda sock, dl: self._push_once(sock, dl, path, f, entry, what))
        return forward_report(answer, forward)

    def _push_once(self, sock: Any, dl: wire.Deadline, path: str, f: Any, entry: FileEntry, what: str) -> bytes:
        """Head with ``Expect: 100-continue`` (a refused upload costs no bandwidth), the body by
        ``sendfile`` once the peer said continue, then its answer."""
        headers = self._headers("PUT", path, entry.size, entry.xxh3_128)
        headers["Content-Type"] = "application/octet-stream"
        headers["Expect"] = "100-continue"
        wire.send_head(sock, "PUT", path, self.endpoint, headers, self.timeout, dl)
        answer = wire.read_head(sock, self.timeout, dl)
        if answer.status == 100:
            wire.send_file(sock, f, entry.size, self.timeout, dl, self.limiter)
            answer = wire.read_head(sock, self.timeout, dl, answer.rest)
        self._answer_status(sock, answer, what, dl)
        return wire.read_small_body(sock, answer, 1 << 20, self.timeout, dl)

    def fetch_file(self, namespace: str, relpath: str, dest: str | os.PathLike,
                   entry: FileEntry | None = None, sync_dir: bool = True) -> FileEntry:
        """Download ``namespace/relpath`` to ``dest`` (temp file, verified, fsync'ed, renamed: ``dest``
        is never partial). Verified against the peer's declared checksum, and ``entry`` when given.
        ``sync_dir=False``: the caller makes the rename durable (one directory fsync for many files).
        The body moves over its own connection (:mod:`supervisor.transport.wire`), in this thread."""
        validate_namespace(namespace)
        validate_relpath(relpath)
        path = f"/v1/files/{_quote_path(namespace, relpath)}"
        what = f"fetch {namespace}/{relpath}"
        with self._slot():
            return self._with_retries(what, lambda: self._exchange(
                what, entry.size if entry is not None else 0,
                lambda sock, dl: self._fetch_once(sock, dl, path, Path(dest), entry, what, sync_dir)))

    # ------------------------------------------------------------ file bodies

    def _fetch_once(self, sock: Any, dl: wire.Deadline, path: str, dest: Path, entry: FileEntry | None,
                    what: str, sync_dir: bool) -> FileEntry:
        wire.send_head(sock, "GET", path, self.endpoint, self._headers("GET", path), self.timeout, dl)
        answer = wire.read_head(sock, self.timeout, dl)
        self._answer_status(sock, answer, what, dl)
        declared = answer.headers.get(H_XXH3.lower(), "").lower()
        length = answer.headers.get("content-length", "")
        if not declared or not length.isdigit():
            raise self._err(f"{what}: answer lacks {H_XXH3} or Content-Length")
        size = answer.length()
        if entry is None:
            dl.sized(size)  # with an entry the deadline already fits its size (checked next)
        if entry is not None and (entry.size != size or entry.xxh3_128 != declared):
            raise self._err(f"{what}: peer holds size {size} xxh3 {declared}, "
                            f"expected size {entry.size} xxh3 {entry.xxh3_128}")
        self._receive(sock, answer.rest, dl, dest, FileEntry(size, declared), what, sync_dir)
        return FileEntry(size, declared)

    def _receive(self, sock: Any, first: bytes, dl: wire.Deadline, dest: Path, declared: FileEntry, what: str,
                 sync_dir: bool) -> None:
        """The body into a temp file beside ``dest`` (a reserved name: the format's leftover cleaner
        knows it), hashed while it arrives, fsync'ed and renamed over ``dest`` only when its size and
        xxh3 match ``declared``; removed otherwise. ``dest`` is never partial."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(reserved_name(Kind.TMP, dest.name[:_LABEL_MAX]))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        ok = False
        try:
            digest = wire.receive_to_fd(sock, first, fd, declared.size, self.timeout, dl, self.limiter, start_disk=True)
            if digest != declared.xxh3_128:
                raise self._err(f"{what}: received bytes do not match xxh3 {declared.xxh3_128}", retryable=True)
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, dest)
            ok = True  # dest is complete and verified from here on
            if sync_dir:
                fsync_dir(dest.parent)
        finally:
            if fd >= 0:
                os.close(fd)
            if not ok:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
