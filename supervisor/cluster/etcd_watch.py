"""One etcd v3 watch over the gRPC gateway: what lets a wait on the etcd store sleep until its keys change.

A wait that polls sends one transaction per poll interval whatever happens; at 128 nodes waiting for
node 0's plan that was most of etcd's load. The events carry the values written, which the store keeps
(:attr:`EtcdWatch.values`) so that the poll after a wake reads from etcd only the keys no event brought. A watch (``POST /v3/watch``, one ``create_request`` per key
range, all in one request body) streams an event when a watched key is written, from a given revision
on, so a wait started right after a poll at revision R and watching from R+1 misses nothing. The stream
holds its HTTP connection for as long as it is open (it is the connection's answer), so each watch has
its own; it ends with the connection.

Anything unexpected (the member gone, the stream ended, a message that does not parse or is over the
limit, a watch canceled by etcd, e.g. because its revision was compacted) is :class:`WatchBroken`: the
store then falls back to polling, which never depended on the watch.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Sequence

from supervisor.cluster import etcd_http

#: The largest watch message taken (one message may carry many events, values included); a larger one breaks
#: the watch (the wait polls instead), so a runaway value never grows the client's memory without bound.
MAX_WATCH_MESSAGE_BYTES = 16 * 1024 * 1024


class WatchBroken(Exception):
    """The watch cannot be trusted to report changes any more; poll instead."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class EtcdWatch:
    """A watch stream on one member for ``keys``, covered by ``ranges`` (``(key, range_end)``; range_end None
    for one key), reporting writes after ``start_revision`` - 1."""

    def __init__(self, conn: etcd_http.Connection, keys: frozenset[str], ranges: Sequence[tuple[bytes, bytes | None]],
                 start_revision: int, limit: int = MAX_WATCH_MESSAGE_BYTES) -> None:
        self.conn, self.keys, self.limit = conn, keys, limit
        self.values: dict[str, bytes] = {}  # the watched keys' values as written since the start revision
        self.body = b"".join(json.dumps({"create_request": _create(key, end, start_revision)}).encode()
                             for key, end in ranges)

    def open(self, deadline: float) -> "EtcdWatch":
        """Send the watch's creates and read the answer's head; :class:`WatchBroken` if it is not a stream."""
        try:
            status = self.conn.open_stream("/v3/watch", self.body, deadline)
        except etcd_http.HTTPError as e:
            self.close()
            raise WatchBroken(f"{e.kind}: {e}") from e
        if status != 200:
            self.close()
            raise WatchBroken(f"the watch was refused with HTTP {status}")
        return self

    def changed(self, deadline: float) -> bool:
        """Whether a watched range was written: True at the first event, False when none came by ``deadline``."""
        while True:
            try:
                raw = self.conn.next_message(deadline, self.limit)
            except etcd_http.HTTPError as e:
                self.close()
                raise WatchBroken(f"{e.kind}: {e}") from e
            if raw is None:
                return False
            if self._events(raw):
                return True

    def _events(self, raw: bytes) -> bool:
        """Whether one stream message reports events; :class:`WatchBroken` for an error, a cancel, or junk."""
        try:
            message = json.loads(raw)
        except ValueError as e:
            self.close()
            raise WatchBroken(f"a watch message that is not JSON: {raw[:80]!r}") from e
        result = message.get("result") if isinstance(message, dict) else None
        if not isinstance(result, dict):
            self.close()
            error = message.get("error") if isinstance(message, dict) else None
            raise WatchBroken(f"the watch stream failed: {error or raw[:80]!r}")
        if result.get("canceled") or result.get("compact_revision"):
            self.close()
            raise WatchBroken(f"etcd canceled the watch: {result.get('cancel_reason') or 'its revision was compacted'}")
        events = result.get("events") or []
        try:
            for event in events:
                key = base64.b64decode(event["kv"]["key"], validate=True).decode()
                if key not in self.keys:
                    continue
                if event.get("type") == "DELETE":
                    self.values.pop(key, None)
                else:
                    self.values[key] = base64.b64decode(event["kv"].get("value", ""), validate=True)
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # binascii.Error, UnicodeDecodeError are ValueErrors
            self.close()
            raise WatchBroken(f"a watch event that does not parse: {e!r}") from e
        return bool(events)

    def close(self) -> None:
        self.conn.close()


def _create(key: bytes, end: bytes | None, start_revision: int) -> dict[str, Any]:
    request: dict[str, Any] = {"key": _b64(key), "start_revision": start_revision}
    if end is not None:
        request["range_end"] = _b64(end)
    return request
