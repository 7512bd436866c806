"""The etcd v3 coordination store: :class:`supervisor.cluster.kvstore.KVStore` on a highly available etcd cluster.

The embedded store (hosted by node 0's supervisor) dies with node 0; etcd keeps serving while a majority of its
members live, so losing any one node, or one etcd member, stalls nobody. We talk to etcd's gRPC
gateway (plain HTTP/JSON, ``/v3/...``, etcd >= 3.4) over keep-alive connections of our own
(:mod:`supervisor.cluster.etcd_http`: a third of ``http.client``'s CPU per request, which is what bounds a
round of many nodes on few cores), so no gRPC stack is needed. A wait watches its keys
(:mod:`supervisor.cluster.etcd_watch`, :meth:`EtcdKVStore.wait_for_change`) instead of polling them.

Failover: every operation goes to the member that answered last; when that member refuses, resets or
does not answer within the per-request timeout, the same operation is retried on the next member, and
round after round (with a short back-off) until ``timeout_s`` has passed since the call began. Only
then is :class:`StoreUnavailable` raised, naming every endpoint tried and the last error. Reads are
linearizable (etcd's default), so a member cut off from the majority times out instead of answering
stale values, and the call moves on.

Retrying is safe because every write is idempotent or decided by a compare: ``set`` and
``delete_prefix`` repeat harmlessly, ``create`` reads back whoever won, and ``add`` writes a one-off
receipt in the same transaction, so a retry after an attempt whose outcome was lost (the member died
mid-request) finds its own receipt instead of adding twice.
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
import threading
import time
import uuid
from typing import Any, Sequence

from supervisor.cluster import etcd_http
from supervisor.cluster.etcd_watch import MAX_WATCH_MESSAGE_BYTES, EtcdWatch, WatchBroken
from supervisor.cluster.kvstore import StoreUnavailable, value_bytes

log = logging.getLogger(__name__)

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops; get_many splits larger requests into several txns
_RETRYABLE_STATUS = (500, 503, 504, 408)  # etcd: no leader, leader changed, request timed out, stopping
WATCH_CHECK_S = 1.0  # a waiting thread polls at least this often even when its watch tells nothing
WATCH_RETRY_S = 1.0  # after a watch failed, a thread polls this long before it opens another
WATCH_COALESCE_S = 0.05  # a change is told at most this long after the last poll (the longest poll interval)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _value(kv: dict[str, Any]) -> bytes:
    """A key's value from a gateway KeyValue (the gateway omits an empty value)."""
    return base64.b64decode(kv.get("value", ""))


def _etcd_error(response: etcd_http.Response) -> str:
    """etcd's own message in an error answer (the gateway writes ``{"error": ..., "message": ...}``)."""
    try:
        d = json.loads(response.body)
        return str(d.get("message") or d.get("error") or d)
    except (ValueError, AttributeError):
        return response.body[:200].decode("utf-8", "replace") or "(no body)"


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key above every key starting with ``prefix`` (etcd's range_end for a prefix)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"  # etcd: range_end "\0" means "to the end of the keyspace"
    end[-1] += 1
    return bytes(end)


class _Unanswered(Exception):
    """One member did not answer (connection refused/reset, timeout, or etcd said it cannot serve now)."""


class _Member:
    """One member's address and its idle keep-alive connections (a store may be used from several threads)."""

    def __init__(self, endpoint: str, context: ssl.SSLContext | None) -> None:
        scheme, _, hostport = endpoint.rpartition("://")
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit() or scheme not in ("", "http", "https"):
            raise ValueError(f"etcd endpoint {endpoint!r} is not host:port")
        if scheme == "https" and context is None:
            context = ssl.create_default_context()
        self.host, self.port = host.strip("[]"), int(port)
        self.context = None if scheme == "http" else context
        self._idle: list[etcd_http.Connection] = []
        self._lock = threading.Lock()

    def connection(self) -> etcd_http.Connection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return etcd_http.Connection(self.host, self.port, self.context)

    def keep(self, conn: etcd_http.Connection) -> None:
        if conn.is_open:
            with self._lock:
                self._idle.append(conn)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class _ThreadState(threading.local):
    """A thread's last poll (the revision its watch starts after) and its open watch."""

    revision: int | None = None
    polled_at: float = 0.0
    watch: "EtcdWatch | None" = None
    watch_member: int = 0  # the member the watch is on
    watch_failed_at: float = float("-inf")


class EtcdKVStore:
    """The coordination store on an etcd v3 cluster, failing over between its members.

    ``endpoints``: the members' client addresses, ``host:port`` (``http://`` or ``https://`` prefixes
    are accepted). ``timeout_s``: how long one call may take, failovers and retries included.
    ``request_timeout_s``: how long one member may take to answer before the call tries the next
    (default: a third of ``timeout_s``, at most 2 s; etcd answers in milliseconds when healthy).
    ``ca_cert``/``cert_cert``/``cert_key``: TLS (a CA to verify the members, a client certificate).
    Members are reached directly (no HTTP proxy), over keep-alive connections.
    """

    def __init__(self, endpoints: Sequence[str], timeout_s: float, *, request_timeout_s: float | None = None,
                 ca_cert: str | None = None, cert_cert: str | None = None, cert_key: str | None = None) -> None:
        if not endpoints:
            raise ValueError("EtcdKVStore needs at least one endpoint")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.endpoints = [e.strip() for e in endpoints]
        self.timeout_s = timeout_s
        self.request_timeout_s = request_timeout_s if request_timeout_s else min(2.0, timeout_s / 3)
        context = None
        if ca_cert or (cert_cert and cert_key):
            context = ssl.create_default_context(cafile=ca_cert or None)
            if cert_cert and cert_key:
                context.load_cert_chain(cert_cert, cert_key)
        self._members = [_Member(e, context) for e in self.endpoints]
        self._current = 0  # the member that answered last
        self._lock = threading.Lock()
        self._local = _ThreadState()
        self._watches: list[EtcdWatch] = []  # every thread's open watch, for close()
        self.watch_message_limit = MAX_WATCH_MESSAGE_BYTES

    @property
    def endpoint(self) -> str:
        """The member calls go to now (the one that answered last)."""
        return self.endpoints[self._current]

    def describe(self) -> str:
        return f"etcd {','.join(self.endpoints)}"

    def _post(self, what: str, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST ``payload`` to ``/v3/<path>`` on a member that answers, failing over within ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        tried: list[str] = []
        last = "no attempt"
        backoff = 0.05
        with self._lock:
            start = self._current
        while True:
            for step in range(len(self._members)):
                i = (start + step) % len(self._members)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                if self.endpoints[i] not in tried:
                    tried.append(self.endpoints[i])
                try:
                    result = self._attempt(i, path, payload, min(self.request_timeout_s, remaining))
                except _Unanswered as e:
                    last = f"{self.endpoints[i]}: {e}"
                    continue
                with self._lock:
                    self._current = i
                return result
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreUnavailable(f"coordination store {self.describe()}: {what} failed: no etcd member "
                                       f"answered within {self.timeout_s:g}s (tried {', '.join(tried)}); "
                                       f"last error: {last}")
            time.sleep(min(backoff, remaining))  # every member failed at once: an election, or a restart
            backoff = min(backoff * 2, 0.5)

    def _attempt(self, i: int, path: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One POST to member ``i``. A kept connection the member closed meanwhile (it restarted) is retried
        once on a new one; every operation is safe to repeat (see the module docstring)."""
        member = self._members[i]
        body = json.dumps(payload, separators=(",", ":")).encode()
        deadline = time.monotonic() + timeout
        while True:
            conn = member.connection()
            reused = conn.is_open
            try:
                response = conn.post(f"/v3/{path}", body, deadline)
                break
            except etcd_http.Closed as e:
                if reused:
                    continue
                raise _Unanswered(f"{e.kind}: {e}") from e
            except etcd_http.HTTPError as e:
                conn.close()
                raise _Unanswered(f"{e.kind}: {e}") from e
        if response.status == 200:
            member.keep(conn)
            try:
                result = json.loads(response.body)
            except ValueError as e:  # a broken response (not JSON)
                raise _Unanswered(f"an answer that is not JSON: {e}") from e
            if not isinstance(result, dict):
                raise _Unanswered(f"an answer that is not a JSON object: {response.body[:80]!r}")
            return result
        conn.close()
        why = _etcd_error(response)
        if response.status in _RETRYABLE_STATUS:
            raise _Unanswered(f"HTTP {response.status}: {why}")
        # 4xx: etcd refused the request itself; no member would take it
        raise StoreUnavailable(f"coordination store {self.describe()}: {path} rejected by "
                               f"{self.endpoints[i]}: HTTP {response.status}: {why}")

    def _txn(self, what: str, compare: list[dict[str, Any]], success: list[dict[str, Any]],
             failure: Sequence[dict[str, Any]] = (), seen: list[int] | None = None) -> tuple[bool, list[dict[str, Any]]]:
        """One etcd transaction: whether the compares held, and the branch's responses; its revision is
        appended to ``seen`` when given."""
        result = self._post(what, "kv/txn", {"compare": compare, "success": success, "failure": list(failure)})
        if seen is not None:
            seen.append(int(result.get("header", {}).get("revision", 0)))
        # The gateway writes proto3 JSON: false, empty and zero fields are left out.
        return bool(result.get("succeeded", False)), result.get("responses", [])

    def set(self, key: str, value: bytes) -> None:
        self._post("set", "kv/put", {"key": _b64(key.encode()), "value": _b64(value_bytes(value))})

    def get(self, key: str) -> bytes | None:
        kvs = self._post("get", "kv/range", {"key": _b64(key.encode())}).get("kvs", [])
        return _value(kvs[0]) if kvs else None

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """A transaction of range reads per :data:`MAX_TXN_OPS` keys: one round trip (and one revision) each."""
        keys = list(keys)
        out: list[bytes | None] = []
        for first in range(0, len(keys), MAX_TXN_OPS):
            batch = keys[first:first + MAX_TXN_OPS]
            _, responses = self._txn("get_many", [], [{"request_range": {"key": _b64(k.encode())}} for k in batch])
            for r in responses:
                kvs = r.get("response_range", {}).get("kvs", [])
                out.append(_value(kvs[0]) if kvs else None)
        return out

    def poll(self, keys: Sequence[str], other: str | None = None) -> tuple[list[bytes] | None, bytes | None]:
        """Up to :data:`MAX_TXN_OPS` keys, one transaction: compares that every key exists (create_revision
        > 0), their reads on success, the read of ``other`` on failure (nothing else moves while a key is
        missing). More keys: a compare-only transaction per batch, stopping at the first with a key missing.
        The (first) transaction's revision is where this thread's :meth:`wait_for_change` watches from; keys
        whose writes that watch reported are not read again."""
        keys = list(keys)
        seen: list[int] = []
        watch = self._local.watch  # keys its events brought need no read (they are only rewritten by a set,
        brought = watch.values if watch is not None else {}  # which the watch would have told too)
        rest = [k for k in keys if k not in brought]
        try:
            if keys and not rest:
                return [brought[k] for k in keys], None
            values, other_value = self._poll(rest, other, seen)
            if values is None or len(rest) == len(keys):
                return values, other_value
            read = dict(zip(rest, values))
            return [read[k] if k in read else brought[k] for k in keys], None
        finally:
            if seen and seen[0] > 0:
                self._local.revision, self._local.polled_at = seen[0], time.monotonic()

    def _poll(self, keys: list[str], other: str | None, seen: list[int]) -> tuple[list[bytes] | None, bytes | None]:
        compare = [{"key": _b64(k.encode()), "target": "CREATE", "result": "GREATER", "create_revision": 0}
                   for k in keys]
        if len(keys) > MAX_TXN_OPS:
            if all(self._txn("poll", compare[i:i + MAX_TXN_OPS], [], seen=seen)[0]
                   for i in range(0, len(keys), MAX_TXN_OPS)):
                values = self.get_many(keys)
                if all(v is not None for v in values):  # else a key went (delete_prefix) since the compares
                    return [v for v in values if v is not None], None
            return None, self.get(other) if other is not None else None
        failure = [{"request_range": {"key": _b64(other.encode())}}] if other is not None else []
        present, responses = self._txn("poll", compare, [{"request_range": {"key": c["key"]}} for c in compare],
                                       failure, seen=seen)
        if present:
            return [_value(r["response_range"]["kvs"][0]) for r in responses], None
        kvs = responses[0].get("response_range", {}).get("kvs", []) if failure and responses else []
        return None, _value(kvs[0]) if kvs else None

    def wait_for_change(self, keys: Sequence[str], timeout: float) -> bool:
        """Up to ``timeout`` for a write to one of ``keys`` after this thread's last :meth:`poll` (a watch from
        its revision, kept while later waits watch no other keys); False when none came. A change is told no
        sooner than ``timeout`` (at most :data:`WATCH_COALESCE_S`) after that poll (writes that come in a burst
        wake one poll, not one each: node 0's wait for every node's key polls as often as before), and
        True also means "poll anyway": no poll yet, none for :data:`WATCH_CHECK_S`, or the watch failed (for
        :data:`WATCH_RETRY_S` this thread then sleeps and polls as the embedded store does)."""
        state = self._local
        now = time.monotonic()
        if state.revision is None or now - state.polled_at >= WATCH_CHECK_S or not keys:
            time.sleep(timeout if state.revision is None or not keys else 0)
            return True
        try:
            watch = self._watch(frozenset(keys), now)
            if watch is None:
                time.sleep(timeout)
                return True
            if not watch.changed(now + timeout):
                return False
        except WatchBroken as e:
            self._drop_watch()
            state.watch_failed_at = time.monotonic()
            log.info("etcd watch on %s failed (%s); this wait polls instead", self.endpoint, e)
            return True
        time.sleep(max(0.0, state.polled_at + min(timeout, WATCH_COALESCE_S) - time.monotonic()))
        return True

    def _watch(self, keys: frozenset[str], now: float) -> EtcdWatch | None:
        """This thread's watch covering ``keys`` from its last poll's revision: the open one, or a new one
        (None while a failed one is recent)."""
        state = self._local
        current = self._current  # a watch on a member the calls left (cut off, say) may never report again
        if state.watch is not None and keys <= state.watch.keys and state.watch_member == current:
            return state.watch
        self._drop_watch()
        if now - state.watch_failed_at < WATCH_RETRY_S:
            return None
        assert state.revision is not None
        member = self._members[current]
        watch = EtcdWatch(etcd_http.Connection(member.host, member.port, member.context), keys, _watch_ranges(keys),
                          state.revision + 1, self.watch_message_limit)
        state.watch, state.watch_member = watch.open(now + self.request_timeout_s), current
        with self._lock:
            self._watches.append(watch)
        return watch

    def _drop_watch(self) -> None:
        watch, self._local.watch = self._local.watch, None
        if watch is not None:
            watch.close()
            with self._lock:
                if watch in self._watches:
                    self._watches.remove(watch)

    def create(self, key: str, value: bytes) -> bytes:
        """Put-if-absent (create_revision == 0) in one transaction that reads the winner's value otherwise."""
        k = _b64(key.encode())
        won, responses = self._txn(
            "create", [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": 0}],
            [{"request_put": {"key": k, "value": _b64(value_bytes(value))}}], [{"request_range": {"key": k}}])
        if won:
            return value_bytes(value)
        kvs = responses[0].get("response_range", {}).get("kvs", []) if responses else []
        if not kvs:  # a key deleted (delete_prefix) between the compare and now cannot happen in one txn
            raise StoreUnavailable(f"coordination store {self.describe()}: create {key!r}: etcd returned no value")
        return _value(kvs[0])

    def add(self, key: str, amount: int) -> int:
        """A compare-and-swap loop on the key's mod_revision; the value is the decimal text, as in the embedded store.

        Each attempt also writes a receipt key (``<key>\\0add\\0<uuid>``, holding the new total) in the same
        transaction, and reads it back when the compare fails: if a member died after committing our
        attempt but before answering, the retry finds the receipt and returns its total instead of adding
        again. The receipt is deleted afterwards (a receipt left by a crash goes with delete_prefix).
        """
        k = _b64(key.encode())
        receipt = _b64(key.encode() + b"\0add\0" + uuid.uuid4().hex.encode())
        kvs = self._post("add", "kv/range", {"key": k}).get("kvs", [])
        while True:
            if kvs:
                compare = {"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": kvs[0]["mod_revision"]}
                total = int(_value(kvs[0]) or b"0") + amount
            else:
                compare = {"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": 0}
                total = amount
            new = _b64(str(total).encode())
            won, responses = self._txn(
                "add", [compare],
                [{"request_put": {"key": k, "value": new}}, {"request_put": {"key": receipt, "value": new}}],
                [{"request_range": {"key": k}}, {"request_range": {"key": receipt}}])
            if not won:
                mine = responses[1].get("response_range", {}).get("kvs", [])
                if not mine:  # someone else moved the counter first: try again on the value they left
                    kvs = responses[0].get("response_range", {}).get("kvs", [])
                    continue
                total = int(_value(mine[0]))  # an earlier attempt of ours committed; its answer was lost
            try:
                self._post("add", "kv/deleterange", {"key": receipt})
            except StoreUnavailable:
                pass  # the add itself is done; raising would invite the caller to add again
            return total

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._post("delete", "kv/deleterange", {"key": _b64(key.encode())})

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key starting with ``prefix``; an empty prefix is refused (the cluster may be shared)."""
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix: an etcd cluster outlives and outnumbers jobs")
        p = prefix.encode()
        self._post("delete_prefix", "kv/deleterange", {"key": _b64(p), "range_end": _b64(_prefix_end(p))})

    def close(self) -> None:
        with self._lock:
            watches, self._watches = self._watches, []
        for watch in watches:
            watch.close()
        for member in self._members:
            member.close()


def _watch_ranges(keys: frozenset[str]) -> list[tuple[bytes, bytes | None]]:
    """Key ranges covering ``keys``, one per parent (``inv/3/0`` .. ``inv/3/127``: ``[inv/3/0, inv/3/127\\0)``),
    so that a wait on every node's key watches one range and never its siblings' parents."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(key.rpartition("/")[0], []).append(key)
    ranges: list[tuple[bytes, bytes | None]] = []
    for members in groups.values():
        low, high = min(members).encode(), max(members).encode()
        ranges.append((low, None if low == high else high + b"\0"))
    return sorted(ranges)
