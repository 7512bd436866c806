"""The replication server: an authenticated HTTP/1.1 file service over a :class:`ReplicaStore`.

Runs aiohttp in a background thread with its own event loop (``start()`` returns the bound port,
``stop()`` shuts it down). Routes, all authenticated (see :mod:`supervisor.transport.auth`)::

    GET    /v1/health                      {"ok": true, "time": ...}
    PUT    /v1/files/<namespace>/<relpath>[?forward=host:port,...]
                                           body = file; Content-Length and X-Rlsup-Xxh3 required;
                                           {"size": N, "xxh3_128": hex, "forwarded": {endpoint: "queued"}}
    GET    /v1/files/<namespace>/<relpath> the file, with Content-Length and X-Rlsup-Xxh3
    DELETE /v1/files/<namespace>/<prefix>  {"removed": N} (whole segments: step_1 never hits step_10)
    GET    /v1/index/<namespace>           {"files": {relpath: {"size": N, "xxh3_128": hex}}}
    GET    /v1/forwards/<namespace>/<relpath> {"forwarded": {endpoint: "queued"|"ok"|why}} (recent chains)
    <extra JSON routes mounted with add_json_route>

Robustness: paths are taken from the raw request line (never a normalised or percent-decoded form;
a ``%`` anywhere in the path is refused) and validated by the store; bodies are streamed to disk
(at most about 8 MiB buffered per upload: socket reads are batched, ~4 MiB per ``writev`` and
hash call, one batch written while the next is read) and verified before they replace anything; a PUT that declares
more than ``max_file_bytes`` is answered 413 before its body is read (clients send
``Expect: 100-continue``, so a refused upload costs no bandwidth); a body that stalls for
``request_timeout`` seconds is dropped; a connection that has not delivered a complete request head
within ``header_timeout`` seconds is closed (slowloris); request lines and header fields longer than
``max_header_bytes`` are refused by aiohttp's parser (400/431); garbage on the socket gets a 400 and
a closed connection. At most ``max_connections`` connections are held: when the table is full, a new
connection evicts the idle one that has gone longest without a complete request head (connections
that never authenticated a request go first, a peer's idle keep-alive connection last; one serving a
request is never evicted), so a flood of half-open connections cannot starve the peers; only when
every held connection is serving a request is the new one closed at once.

Chains (:mod:`supervisor.transport.forward`): a PUT whose query names further hops is answered once
stored here and then sent on to the next one in the background, to allow-listed peers only
(``forward_peers``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import ssl
import threading
import time
from typing import Any, Callable, Collection

from aiohttp import web

from supervisor.transport.client import PeerClient
from supervisor.transport.conns import HeldConn, Reject, Tracked
from supervisor.transport.raw_upload import HTTPError as _HTTPError, receive_raw, take_socket
from supervisor.transport.forward import ForwardRefused, Forwarder, lower_thread_priority, parse_forward
from supervisor.transport.auth import H_XXH3, Verifier, body_digest
from supervisor.transport.store import (IntegrityError, ReplicaStore, StoreError, validate_namespace,
                                       validate_relpath)

log = logging.getLogger("rlsup.transport.server")

CHUNK = 1 << 20
_SEND_SEGMENT = 32 << 20  # bytes per sendfile call of a GET (each within request_timeout)
#: Received bytes handed to the disk thread per call (one writev + hash).
BATCH = 4 << 20
_AUTHED: Any = web.RequestKey("rlsup_authenticated", bool) if hasattr(web, "RequestKey") else "rlsup_authenticated"
_RESERVED = ("/v1/health", "/v1/files/", "/v1/index/", "/v1/forwards/")


class _QuietBadRequests(logging.Filter):
    """Garbage on the socket is expected from the network: log it in one line at DEBUG, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg = f"{record.getMessage()}: {type(exc).__name__}: {exc.message}"
            record.args = ()
            record.exc_info = None
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return log.isEnabledFor(logging.DEBUG)
        return True


http_log = logging.getLogger("rlsup.transport.http")
http_log.addFilter(_QuietBadRequests())


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _read(content: Any) -> bytes:
    """The next chunk of a request body (b"" at its end); 400 when the body is cut or malformed.
    One received buffer as it is: ``readany`` would join all that are buffered (a copy)."""
    try:
        return (await content.readchunk())[0]  # chunked bodies are refused: no HTTP chunk splits here
    except (asyncio.CancelledError, TimeoutError):
        raise
    except Exception as e:  # noqa: BLE001 - peer closed mid-body, payload error
        raise _HTTPError(400, f"body incomplete: {type(e).__name__}: {e}") from None


class ReplicationServer:
    def __init__(self, store: ReplicaStore, secret: bytes, host: str = "127.0.0.1", port: int = 0,
                 max_file_bytes: int = 1 << 40, max_header_bytes: int = 8192,
                 ssl_context: ssl.SSLContext | None = None, request_timeout: float = 60.0,
                 header_timeout: float = 15.0, max_connections: int = 256, max_json_bytes: int = 1 << 20,
                 io_threads: int = 8, forward_peers: Collection[str] = (), own_endpoint: str = "",
                 forward_ssl: ssl.SSLContext | None = None) -> None:
        """``forward_peers``: the endpoints (host:port) a PUT may be forwarded to (the job's other
        nodes); ``own_endpoint``: this server as the peers name it (refused in a forward list: a
        loop); ``forward_ssl``: the client TLS context for forwards (None: plain HTTP)."""
        self.store = store
        self.verifier = Verifier(secret)
        self._secret = bytes(secret)
        self.forward_peers = frozenset(forward_peers)
        self.own_endpoint = own_endpoint
        self.forward_ssl = forward_ssl
        self._forward_pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="rlsup-forward",
                                                                   initializer=lower_thread_priority)
        # Raw uploads hold a thread for their whole body: their own pool, as large as the connection table.
        self._uploads = concurrent.futures.ThreadPoolExecutor(max_workers=max_connections,
                                                              thread_name_prefix="rlsup-upload")
        self._forwarder = Forwarder(store, lambda ep: PeerClient(ep, self._secret, timeout=request_timeout, retries=1,
                                                                 ssl_context=forward_ssl), self._forward_pool)
        self.host = host
        self.port = port
        self.max_file_bytes = max_file_bytes
        self.max_header_bytes = max_header_bytes
        self.ssl_context = ssl_context
        self.request_timeout = request_timeout
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.max_json_bytes = max_json_bytes
        self._io = concurrent.futures.ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="rlsup-io")
        self._json_routes: dict[tuple[str, str], Callable[[dict], dict]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._server: asyncio.base_events.Server | None = None
        self._stopped = threading.Event()
        self._conns: dict[Any, HeldConn] = {}  # held connections by aiohttp handler; event-loop thread only
        self._fresh = 0  # accepted in this loop iteration, not yet in _conns (connection_made is call_soon)

    # ------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://{self.host}:{self.port}"

    def add_json_route(self, method: str, path: str, handler: Callable[[dict], dict]) -> None:
        """Mount an authenticated JSON route (any time, also while running). ``handler`` is a sync
        callable run in a worker thread: it gets the JSON body (object) for methods with a body, the
        query parameters (str -> str) for GET/DELETE, and returns a JSON-serialisable dict. A
        ValueError/KeyError/TypeError it raises is answered 400 with its message, anything else 500."""
        if not path.startswith("/v1/") or "%" in path or "?" in path:
            raise ValueError(f"JSON route path must start with /v1/ and contain no '%' or '?': {path!r}")
        if path == "/v1/health" or any(path.startswith(p) for p in _RESERVED[1:]):
            raise ValueError(f"{path!r} collides with a built-in route")
        self._json_routes[(method.upper(), path)] = handler

    def start(self) -> int:
        """Bind and serve in a background thread; returns the bound port (errors re-raised here)."""
        if self._thread is not None:
            raise RuntimeError("server already started")
        ready: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="rlsup-replication-server",
                                        daemon=True)
        self._thread.start()
        try:
            self.port = ready.result(timeout=30)
        except BaseException:
            self._thread.join(timeout=5)
            self._thread = None
            raise
        return self.port

    def stop(self, timeout: float = 10.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if not self._stopped.is_set():
            try:
                fut = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
                fut.result(timeout=timeout)
            except Exception as e:  # noqa: BLE001 - best effort; the thread is told to stop anyway
                log.warning("replication server shutdown: %s", e)
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=timeout)
        self._thread = None
        self._io.shutdown(wait=False, cancel_futures=True)
        self._forward_pool.shutdown(wait=False, cancel_futures=True)
        self._uploads.shutdown(wait=False, cancel_futures=True)
        self._forwarder.close()
        self.store.flush()

    def __enter__(self) -> "ReplicationServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self, ready: concurrent.futures.Future) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._setup())
        except BaseException as e:  # noqa: BLE001 - handed to start()
            ready.set_exception(e)
            loop.close()
            return
        ready.set_result(self.port)
        try:
            loop.run_forever()
        finally:
            self._stopped.set()
            try:
                pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

    async def _setup(self) -> None:
        app = web.Application(client_max_size=self.max_json_bytes)
        app.router.add_route("*", "/{tail:.*}", self._dispatch, expect_handler=self._expect)
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, logger=http_log,
            keepalive_timeout=self.header_timeout,  # also bounds the wait for a complete request head
            max_line_size=self.max_header_bytes, max_field_size=self.max_header_bytes, max_headers=64,
            read_bufsize=CHUNK, lingering_time=2.0)
        await self._runner.setup()
        server = self._runner.server
        assert server is not None

        def factory() -> asyncio.Protocol:
            if not self._make_room():
                return Reject()
            self._count_fresh()
            return Tracked(server(), self._conns)

        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(factory, self.host, self.port, ssl=self.ssl_context,
                                                reuse_address=True, backlog=128)
        self.port = self._server.sockets[0].getsockname()[1]

    def _count_fresh(self) -> None:
        """Count a connection accepted now until its connection_made has run, so that a burst of
        accepts in one loop iteration cannot overshoot ``max_connections``."""
        if self._fresh == 0:
            asyncio.get_running_loop().call_soon(self._reset_fresh)
        self._fresh += 1

    def _reset_fresh(self) -> None:
        self._fresh = 0

    def _make_room(self) -> bool:
        """Whether a new connection may be held: when the table is full, close the idle connection that
        has gone longest without a complete request head (strangers before peers), so whoever holds the
        slots cannot starve replication. False only when every held connection is serving a request."""
        open_ = [c for c in self._conns.values() if not c.transport.is_closing()]
        if len(open_) + self._fresh < self.max_connections:
            return True
        idle = [c for c in open_ if c.busy == 0]
        if not idle:
            return False
        victim = min(idle, key=HeldConn.evict_key)
        log.debug("replication server: %d connections held, evicting one idle for %.1fs (peer: %s)",
                  len(open_) + self._fresh, time.monotonic() - victim.since, victim.trusted)
        victim.transport.close()
        return True

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.shutdown()
            await self._runner.cleanup()
        if self._server is not None:
            await self._server.wait_closed()

    # ------------------------------------------------------------ request handling

    def _authenticate(self, request: web.Request) -> web.Response | None:
        if request.get(_AUTHED):
            return None
        res = self.verifier.verify(request.method, request.raw_path, request.headers)
        if not res.ok:
            return _error(res.status, res.reason)
        request[_AUTHED] = True
        conn = self._conns.get(request.protocol)
        if conn is not None:
            conn.trusted = True
        return None

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: authenticate and pre-check a PUT before its body is sent."""
        conn = self._conns.get(request.protocol)
        if conn is not None:
            conn.since = time.monotonic()  # a complete head: last in line for eviction
        resp = self._authenticate(request)
        if resp is not None:
            return resp
        if request.headers.get("Expect", "").lower() != "100-continue":
            return _error(417, "unsupported Expect header")
        if request.method == "PUT":
            try:
                self._put_precheck(request)
                self._forward_list(request)
            except _HTTPError as e:
                return _error(e.status, e.message)
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0
        return None

    def _split(self, request: web.Request) -> tuple[str, list[str]]:
        raw = request.raw_path
        path = raw.partition("?")[0]
        if "%" in path or "\\" in path or "\x00" in path:
            raise _HTTPError(400, "percent-encoded, backslash or NUL characters are not accepted in paths")
        if not path.startswith("/v1/"):
            raise _HTTPError(404, f"no route {path!r}")
        return path, path[len("/v1/"):].split("/")

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        """Serve one request with its connection marked busy, so that eviction never cuts a transfer."""
        conn = self._conns.get(request.protocol)
        if conn is None:
            return await self._route(request)
        conn.busy += 1
        conn.since = time.monotonic()
        try:
            return await self._route(request)
        finally:
            conn.busy -= 1
            conn.since = time.monotonic()

    async def _route(self, request: web.Request) -> web.StreamResponse:
        resp = self._authenticate(request)
        if resp is not None:
            return resp
        try:
            path, parts = self._split(request)
            method = request.method
            handler = self._json_routes.get((method, path))
            if handler is not None:
                return await self._json_route(request, handler)
            head = parts[0]
            if head == "health" and len(parts) == 1:
                if method != "GET":
                    raise _HTTPError(405, "use GET")
                return web.json_response({"ok": True, "time": time.time()})
            if head == "files" and len(parts) >= 3:
                ns, rel = parts[1], "/".join(parts[2:])
                if method == "PUT":
                    return await self._put(request, ns, rel)
                if method == "GET":
                    return await self._get(request, ns, rel)
                if method == "DELETE":
                    removed = await self._blocking(self.store.delete, ns, rel)
                    return web.json_response({"removed": removed})
                raise _HTTPError(405, "use PUT, GET or DELETE")
            if head == "forwards" and len(parts) >= 3:
                if method != "GET":
                    raise _HTTPError(405, "use GET")
                ns, rel = parts[1], "/".join(parts[2:])
                validate_namespace(ns)
                validate_relpath(rel)
                return web.json_response({"forwarded": self._forwarder.status(ns, rel)})
            if head == "index" and len(parts) == 2:
                if method != "GET":
                    raise _HTTPError(405, "use GET")
                idx = await self._blocking(self.store.index, parts[1])
                return web.json_response(
                    {"files": {k: {"size": v.size, "xxh3_128": v.xxh3_128} for k, v in sorted(idx.items())}})
            raise _HTTPError(404, f"no route {method} {path}")
        except _HTTPError as e:
            return _error(e.status, e.message)
        except StoreError as e:
            return _error(e.status, str(e))
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as e:  # a bug or I/O error answers 500; the server stays up
            log.exception("replication server: %s %s failed", request.method, request.raw_path)
            return _error(500, f"{type(e).__name__}: {e}")

    async def _blocking(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    def _put_precheck(self, request: web.Request) -> tuple[str, str, int, str]:
        path, parts = self._split(request)
        if len(parts) < 3 or parts[0] != "files":
            raise _HTTPError(404, f"no route PUT {path}")
        if "chunked" in request.headers.get("Transfer-Encoding", "").lower():
            raise _HTTPError(411, "Content-Length required (chunked uploads are not accepted)")
        cl = request.headers.get("Content-Length")
        if cl is None:
            raise _HTTPError(411, "Content-Length required")
        if not cl.isdigit():
            raise _HTTPError(400, "invalid Content-Length")
        size = int(cl)
        if size > self.max_file_bytes:
            raise _HTTPError(413, f"file of {size} bytes exceeds this server's limit of {self.max_file_bytes}")
        xxh3 = request.headers.get(H_XXH3)
        if not xxh3:
            raise _HTTPError(400, f"{H_XXH3} header required")
        ns, rel = parts[1], "/".join(parts[2:])
        validate_namespace(ns)
        validate_relpath(rel)
        return ns, rel, size, xxh3

    def _forward_list(self, request: web.Request) -> tuple[str, ...]:
        """The hops this PUT asks to be forwarded to; 400 naming the endpoint when refused."""
        query = request.raw_path.partition("?")[2]
        if not query:
            return ()
        if "%" in query or "\\" in query or "\x00" in query:
            raise _HTTPError(400, "percent-encoded, backslash or NUL characters are not accepted in the query")
        own = {self.own_endpoint, f"{self.host}:{self.port}"}
        try:
            return parse_forward(query, self.forward_peers, own)
        except ForwardRefused as e:
            raise _HTTPError(400, str(e)) from None

    async def _put(self, request: web.Request, ns: str, rel: str) -> web.StreamResponse:
        ns, rel, size, xxh3 = self._put_precheck(request)
        hops = self._forward_list(request)
        inc = await self._blocking(self.store.begin_write, ns, rel, size, xxh3)
        taken = None
        try:
            taken = take_socket(request) if self.ssl_context is None else None
            if taken is not None:  # the body straight from the socket: recv_into 8 MiB buffers, 2 threads
                entry = await receive_raw(request, inc, *taken, self._uploads, self.request_timeout)
            else:
                last = await self._receive(request, inc)
                if inc.received + sum(map(len, last)) != size:
                    raise IntegrityError(f"body has {inc.received + sum(map(len, last))} bytes, {size} declared")
                entry = await self._blocking(inc.finish, last)
        except BaseException:
            await asyncio.shield(self._blocking(inc.abort))
            raise
        finally:
            if taken is not None:
                taken[0].close()
        # Stored and verified here: sent on in the background, from the page cache, by sendfile.
        forwarded = self._forwarder.enqueue(ns, rel, entry, hops) if hops else {}
        resp = web.json_response({"size": entry.size, "xxh3_128": entry.xxh3_128, "forwarded": forwarded},
                                 status=201)
        if taken is not None:
            resp.force_close()  # aiohttp's parser never saw the body: this connection ends here
        return resp

    async def _receive(self, request: web.Request, inc: Any) -> list[bytes]:
        """Read the body to the disk in batches of about
        :data:`BATCH` bytes (one write in flight while the next batch is read). Returns the last,
        unwritten batch (written with the commit). 408 when the sender sent nothing for
        ``request_timeout`` (time spent waiting for our disk or the next hop does not count)."""
        content, loop = request.content, asyncio.get_running_loop()
        batch: list[bytes] = []
        batched = 0
        writing: asyncio.Future | None = None
        renew_every = min(1.0, self.request_timeout / 4)
        try:
            async with asyncio.timeout(self.request_timeout) as stall:
                renewed = loop.time()
                while chunk := await _read(content):
                    batch.append(chunk)
                    batched += len(chunk)
                    if batched >= BATCH:
                        if writing is not None:
                            await self._unstalled(stall, asyncio.shield(writing))
                        writing = loop.run_in_executor(self._io, inc.write_many, batch)
                        batch, batched = [], 0
                    if (now := loop.time()) - renewed >= renew_every:
                        stall.reschedule(now + self.request_timeout)
                        renewed = now
                if writing is not None:
                    await self._unstalled(stall, asyncio.shield(writing))
        except TimeoutError:
            raise _HTTPError(408, f"body stalled for {self.request_timeout}s") from None
        finally:
            if writing is not None and not writing.done():
                await asyncio.wait([writing])  # never abort (close the fd) under a running write
        return batch

    async def _unstalled(self, stall: Any, aw: Any) -> None:
        """Await ``aw`` (our disk, the next hop) with the sender's stall clock stopped."""
        stall.reschedule(None)
        try:
            await aw
        finally:
            stall.reschedule(asyncio.get_running_loop().time() + self.request_timeout)

    async def _get(self, request: web.Request, ns: str, rel: str) -> web.StreamResponse:
        fd, entry = await self._blocking(self.store.open_read, ns, rel)
        try:
            resp = web.StreamResponse(status=200, headers={H_XXH3: entry.xxh3_128,
                                                           "Content-Type": "application/octet-stream"})
            resp.content_length = entry.size
            await resp.prepare(request)  # a StreamResponse sends its head here, before the body
            await self._send_body(request, fd, entry.size, f"{ns}/{rel}")
            await resp.write_eof()
            return resp
        finally:
            os.close(fd)

    async def _send_body(self, request: web.Request, fd: int, size: int, name: str) -> None:
        """``size`` bytes of ``fd`` by ``loop.sendfile`` (the kernel copies page cache to socket; a TLS
        transport falls back to reads and writes), in segments that must each finish within
        ``request_timeout`` (a client that stopped reading). A file that shrank drops the connection:
        the client sees a short body."""
        transport = request.transport
        if transport is None:
            raise ConnectionError("connection lost")
        loop = asyncio.get_running_loop()
        with open(fd, "rb", closefd=False) as f:
            offset = 0
            while offset < size:
                n = min(_SEND_SEGMENT, size - offset)
                try:
                    sent = await asyncio.wait_for(loop.sendfile(transport, f, offset, n), self.request_timeout)
                except asyncio.TimeoutError:
                    transport.abort()
                    raise ConnectionError("client stopped reading") from None
                if sent < n:
                    transport.abort()
                    raise ConnectionError(f"{name} changed while being sent")
                offset += sent

    async def _json_route(self, request: web.Request, handler: Callable[[dict], dict]) -> web.Response:
        if request.method in ("GET", "DELETE", "HEAD"):
            arg: dict = dict(request.query)
        else:
            try:
                raw = await asyncio.wait_for(request.read(), self.request_timeout)
            except web.HTTPRequestEntityTooLarge:
                raise _HTTPError(413, f"JSON body larger than {self.max_json_bytes} bytes") from None
            except asyncio.TimeoutError:
                raise _HTTPError(408, "body stalled") from None
            declared = request.headers.get(H_XXH3)
            if declared:
                if body_digest(raw) != declared.lower():
                    raise _HTTPError(400, "body does not match its declared xxh3-128")
            try:
                arg = json.loads(raw) if raw else {}
            except ValueError as e:
                raise _HTTPError(400, f"invalid JSON body: {e}") from None
            if not isinstance(arg, dict):
                raise _HTTPError(400, "JSON body must be an object")
        try:
            result = await self._blocking(handler, arg)
        except (ValueError, KeyError, TypeError) as e:
            raise _HTTPError(400, f"{type(e).__name__}: {e}") from None
        if not isinstance(result, dict):
            raise _HTTPError(500, f"route handler returned {type(result).__name__}, not a dict")
        return web.json_response(result)
