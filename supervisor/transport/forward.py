"""Chain replication: a hop that receives a file streams it on to the next hop while it stores it.

A sender that wants a file on several peers pushes it once, to the first of them, naming the others
in the request's query: ``PUT /v1/files/<ns>/<rel>?forward=host:port,host:port``. The query is part
of the signed path (:mod:`supervisor.transport.auth`), so nobody on the wire can redirect a chain.
Each hop checks the list before the body is read (:func:`parse_forward`: only its allow-listed peers,
never itself, no endpoint twice, at most :data:`MAX_HOPS`), then tees every received chunk: to its own
store and to a :class:`Forwarder`, which re-signs the same PUT (same ``Content-Length`` and declared
``X-Rlsup-Xxh3``) with the rest of the list for the next hop. The next hop verifies the bytes
itself, so a hop never vouches for another's copy.

A hop answers after its own commit and after the next hop answered; its answer's ``forwarded``
object reports every endpoint downstream, ``"ok"`` or why not (merged from the next hop's answer).
A downstream failure never fails the local copy; a local failure aborts the forward (the next hop
sees a short body and discards it).
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
from typing import Any, AsyncIterator, Collection

import aiohttp

from supervisor.transport.auth import auth_headers

MAX_HOPS = 8
#: Chunks queued for the next hop before the receiver waits for it (about 16 MiB at 256 KiB reads).
QUEUE_CHUNKS = 64
OK = "ok"
_ENDPOINT_RE = re.compile(r"^(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9][A-Za-z0-9.-]{0,252}):[0-9]{1,5}$")


class ForwardRefused(ValueError):
    """The request's forward list may not be followed; the message names the endpoint."""


def parse_forward(query: str, allowed: Collection[str], own: Collection[str]) -> tuple[str, ...]:
    """The endpoints a PUT's query asks this server to forward to, in order ((): none). ForwardRefused
    for anything but ``forward=<endpoint>[,<endpoint>...]`` of allow-listed peers, without this server
    (a loop), without repeats, at most :data:`MAX_HOPS` long."""
    if not query:
        return ()
    key, sep, value = query.partition("=")
    if key != "forward" or not sep or "&" in value or "=" in value:
        raise ForwardRefused(f"malformed query {query[:200]!r}: want forward=host:port[,host:port...]")
    hops = tuple(value.split(","))
    if len(hops) > MAX_HOPS:
        raise ForwardRefused(f"forward list has {len(hops)} endpoints, at most {MAX_HOPS} are followed")
    for i, ep in enumerate(hops):
        if not _ENDPOINT_RE.match(ep):
            raise ForwardRefused(f"malformed forward endpoint {ep[:200]!r}: want host:port")
        if ep in own:
            raise ForwardRefused(f"forward endpoint {ep} is this server: a loop")
        if ep in hops[:i]:
            raise ForwardRefused(f"forward endpoint {ep} appears twice: a loop")
        if ep not in allowed:
            raise ForwardRefused(f"forward endpoint {ep} is not a peer this server may forward to")
    return hops


def forward_path(path: str, hops: Collection[str]) -> str:
    """``path`` (no query) with the forward list appended, as it is signed and sent."""
    return f"{path}?forward={','.join(hops)}" if hops else path


def not_reached(hops: Collection[str], why: str) -> dict[str, str]:
    return {ep: why for ep in hops}


def forward_report(answer: bytes, forward: Collection[str]) -> dict[str, str]:
    """A sender's view of a push answer: one entry per endpoint it asked to forward to."""
    try:
        data = json.loads(answer) if forward else {}
    except ValueError:
        data = {}
    got = data.get("forwarded") if isinstance(data, dict) else None
    got = got if isinstance(got, dict) else {}
    return {ep: v if isinstance(v := got.get(ep), str) else "not reported by the peer" for ep in forward}


def merge_answer(nxt: str, rest: tuple[str, ...], status: int, body: bytes) -> dict[str, str]:
    """The downstream report from the next hop's answer: ``nxt`` itself, then what it reported."""
    try:
        data = json.loads(body) if body else {}
    except ValueError:
        data = {}
    data = data if isinstance(data, dict) else {}
    if status != 201:
        error = data.get("error") if isinstance(data.get("error"), str) else ""
        return {nxt: f"HTTP {status}{': ' + error if error else ''}",
                **not_reached(rest, f"not reached: {nxt} failed")}
    sub = data.get("forwarded")
    sub = sub if isinstance(sub, dict) else {}
    out = {nxt: OK}
    for ep in rest:
        v = sub.get(ep)
        out[ep] = v if isinstance(v, str) else f"not reported by {nxt}"
    return out


class Forwarder:
    """One file on its way to the next hop: :meth:`feed` every chunk, then :meth:`finish` (the report)
    or :meth:`abort`. Runs on the server's event loop; the chunks are shared, never copied."""

    def __init__(self, session: aiohttp.ClientSession, scheme: str, secret: bytes, path: str,
                 hops: tuple[str, ...], size: int, xxh3: str, timeout: float) -> None:
        self.next, self.rest = hops[0], hops[1:]
        self.timeout = timeout
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(QUEUE_CHUNKS)
        self._report: dict[str, str] | None = None
        sub = forward_path(path, self.rest)
        headers = auth_headers(secret, "PUT", sub, size, xxh3)
        headers["Content-Type"] = "application/octet-stream"
        url = f"{scheme}://{self.next}{sub}"
        self._task = asyncio.ensure_future(self._send(session, url, headers))

    async def _send(self, session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> dict[str, str]:
        from yarl import URL

        try:
            async with session.put(URL(url, encoded=True), data=self._body(), headers=headers,
                                   expect100=True) as resp:
                body = await resp.read()
                return merge_answer(self.next, self.rest, resp.status, body)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the next hop is reported, never raised
            return self._failed(f"{type(e).__name__}: {e or 'connection failed'}")

    async def _body(self) -> AsyncIterator[bytes]:
        while (chunk := await self._queue.get()) is not None:
            yield chunk

    def _failed(self, why: str) -> dict[str, str]:
        return {self.next: why, **not_reached(self.rest, f"not reached: {self.next} failed")}

    def offer(self, chunk: bytes) -> bool:
        """Queue ``chunk`` without waiting; False when the queue is full (then :meth:`feed` it)."""
        if self._task.done():
            return True
        try:
            self._queue.put_nowait(chunk)
            return True
        except asyncio.QueueFull:
            return False

    async def feed(self, chunk: bytes | None) -> None:
        """Queue ``chunk`` (None: the end) for the next hop. A next hop that takes nothing for
        ``timeout`` seconds is dropped; one that failed is skipped."""
        if self._task.done():
            return
        try:
            self._queue.put_nowait(chunk)
            return
        except asyncio.QueueFull:
            pass
        put = asyncio.ensure_future(self._queue.put(chunk))
        done, _ = await asyncio.wait({put, self._task}, timeout=self.timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if put not in done:
            put.cancel()
            if not self._task.done():
                self.abort(f"stopped taking data for {self.timeout:g}s")

    async def finish(self) -> dict[str, str]:
        """After the last chunk: wait for the next hop's answer (it commits, and waits for its own
        next hop, so each hop further down gets ``timeout`` more)."""
        await self.feed(None)
        if self._report is not None:
            return self._report
        limit = self.timeout * (1 + len(self.rest))
        try:
            return await asyncio.wait_for(asyncio.shield(self._task), limit)
        except asyncio.TimeoutError:
            self.abort(f"no answer {limit:g}s after the body was sent")
        except asyncio.CancelledError:
            self.abort("cancelled")
            raise
        assert self._report is not None
        return self._report

    def abort(self, why: str = "aborted: the upload to this hop failed") -> None:
        """Cut the connection to the next hop (it discards the short body)."""
        if self._report is None:
            self._report = self._failed(why)
        if not self._task.done():
            self._task.cancel()


def client_session(ssl_context: ssl.SSLContext | None, connect_timeout: float) -> aiohttp.ClientSession:
    """The session a server forwards with (created on the server's loop; closed with the server)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=64, ssl=ssl_context if ssl_context else False),
        timeout=aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_connect=connect_timeout),
        auto_decompress=False, skip_auto_headers=("User-Agent", "Content-Type"))


def scheme_of(ssl_context: Any) -> str:
    return "https" if ssl_context else "http"
