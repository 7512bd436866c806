"""The etcd v3 coordination store: :class:`supervisor.kvstore.KVStore` on a highly available etcd cluster.

The embedded store (a TCPStore on node 0) dies with node 0; etcd keeps serving while a majority of its
members live, so losing any one node, or one etcd member, stalls nobody. We talk to etcd's gRPC
gateway (plain HTTP/JSON, ``/v3/...``, etcd >= 3.4) through ``etcd3gw``, so no gRPC stack is needed.

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
import os
import threading
import time
import uuid
from typing import Any, Sequence

import requests

from supervisor.kvstore import StoreUnavailable

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops; get_many splits larger requests into several txns
_RETRYABLE_STATUS = (500, 503, 504, 408)  # etcd: no leader, leader changed, request timed out, stopping


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _bytes(value: bytes | str) -> bytes:
    """Values as bytes; str is taken as UTF-8, as TCPStore takes it."""
    return value.encode() if isinstance(value, str) else bytes(value)


def _value(kv: dict[str, Any]) -> bytes:
    """A key's value from a gateway KeyValue (the gateway omits an empty value)."""
    return base64.b64decode(kv.get("value", ""))


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


class _ThreadLimit(threading.local):
    """The calling thread's per-attempt limit (None: a thread that set none uses etcd3gw's own)."""

    timeout: float | None = None


class _DeadlineSession(requests.Session):
    """A session whose every request times out by the calling thread's own per-attempt limit.

    etcd3gw fixes one timeout per client; the limit here shrinks as the call's overall deadline nears,
    so a dead or partitioned member never holds a call past ``timeout_s``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.local = _ThreadLimit()

    def request(self, method: str | bytes, url: str | bytes, *args: Any, **kwargs: Any) -> requests.Response:
        limit = self.local.timeout
        if limit is not None:
            kwargs["timeout"] = limit
        return super().request(method, url, *args, **kwargs)


class EtcdKVStore:
    """The coordination store on an etcd v3 cluster, failing over between its members.

    ``endpoints``: the members' client addresses, ``host:port`` (``http://`` or ``https://`` prefixes
    are accepted). ``timeout_s``: how long one call may take, failovers and retries included.
    ``request_timeout_s``: how long one member may take to answer before the call tries the next
    (default: a third of ``timeout_s``, at most 2 s; etcd answers in milliseconds when healthy).
    ``ca_cert``/``cert_cert``/``cert_key``: TLS (a CA to verify the members, a client certificate).
    """

    def __init__(self, endpoints: Sequence[str], timeout_s: float, *, request_timeout_s: float | None = None,
                 ca_cert: str | None = None, cert_cert: str | None = None, cert_key: str | None = None) -> None:
        import etcd3gw  # the optional extra rlsup[etcd]; imported here so the embedded store never needs it

        if not endpoints:
            raise ValueError("EtcdKVStore needs at least one endpoint")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.endpoints = [e.strip() for e in endpoints]
        self.timeout_s = timeout_s
        self.request_timeout_s = request_timeout_s if request_timeout_s else min(2.0, timeout_s / 3)
        self._session = _DeadlineSession()
        # The environment (proxies, a CA bundle) is read once here, not by requests on every call: that
        # costs a scan of os.environ and stats of ~/.netrc per request, a third of a poll's client CPU.
        self._session.trust_env = False
        self._session.verify = (ca_cert or os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
                                or True)
        if cert_cert and cert_key:
            self._session.cert = (cert_cert, cert_key)
        self._clients: list[Any] = []  # etcd3gw.Etcd3Client, one per member, sharing the session
        self._proxies: list[dict[str, str]] = []  # per member, from the environment (HTTP_PROXY, NO_PROXY, ...)
        for endpoint in self.endpoints:
            scheme, _, hostport = endpoint.rpartition("://")
            host, _, port = hostport.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"etcd endpoint {endpoint!r} is not host:port")
            protocol = scheme or ("https" if ca_cert else "http")
            # api_path given: no version probe per member (etcd >= 3.4 serves /v3/).
            self._clients.append(etcd3gw.Etcd3Client(host=host.strip("[]"), port=int(port), protocol=protocol,
                                                     api_path="/v3/", session=self._session))
            self._proxies.append(requests.utils.get_environ_proxies(self._clients[-1].base_url))
        self._current = 0  # the member that answered last
        self._lock = threading.Lock()

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
            for step in range(len(self._clients)):
                i = (start + step) % len(self._clients)
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
        from etcd3gw import exceptions

        client = self._clients[i]
        self._session.local.timeout = timeout
        try:
            return client.post(client.get_url(path), json=payload, proxies=self._proxies[i])
        except (exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError,
                exceptions.InternalServerError) as e:
            # etcd3gw puts only the HTTP reason in str(e); etcd's own message is in detail_text.
            raise _Unanswered(f"{type(e).__name__}: {e.detail_text or e}") from e
        except exceptions.Etcd3Exception as e:  # 4xx: etcd refused the request itself; no member would take it
            raise StoreUnavailable(f"coordination store {self.describe()}: {path} rejected by "
                                   f"{self.endpoints[i]}: {e.detail_text or e}") from e
        except (requests.RequestException, ValueError) as e:  # a broken response (body cut, not JSON)
            raise _Unanswered(f"{type(e).__name__}: {e}") from e
        finally:
            self._session.local.timeout = None

    def _txn(self, what: str, compare: list[dict[str, Any]], success: list[dict[str, Any]],
             failure: Sequence[dict[str, Any]] = ()) -> tuple[bool, list[dict[str, Any]]]:
        """One etcd transaction: whether the compares held, and the branch's responses."""
        result = self._post(what, "kv/txn", {"compare": compare, "success": success, "failure": list(failure)})
        # The gateway writes proto3 JSON: false, empty and zero fields are left out.
        return bool(result.get("succeeded", False)), result.get("responses", [])

    def set(self, key: str, value: bytes) -> None:
        self._post("set", "kv/put", {"key": _b64(key.encode()), "value": _b64(_bytes(value))})

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
        missing). More keys: a compare-only transaction per batch, stopping at the first with a key missing."""
        keys = list(keys)
        compare = [{"key": _b64(k.encode()), "target": "CREATE", "result": "GREATER", "create_revision": 0}
                   for k in keys]
        if len(keys) > MAX_TXN_OPS:
            if all(self._txn("poll", compare[i:i + MAX_TXN_OPS], [])[0] for i in range(0, len(keys), MAX_TXN_OPS)):
                values = self.get_many(keys)
                if all(v is not None for v in values):  # else a key went (delete_prefix) since the compares
                    return [v for v in values if v is not None], None
            return None, self.get(other) if other is not None else None
        failure = [{"request_range": {"key": _b64(other.encode())}}] if other is not None else []
        present, responses = self._txn("poll", compare, [{"request_range": {"key": c["key"]}} for c in compare],
                                       failure)
        if present:
            return [_value(r["response_range"]["kvs"][0]) for r in responses], None
        kvs = responses[0].get("response_range", {}).get("kvs", []) if failure and responses else []
        return None, _value(kvs[0]) if kvs else None

    def create(self, key: str, value: bytes) -> bytes:
        """Put-if-absent (create_revision == 0) in one transaction that reads the winner's value otherwise."""
        k = _b64(key.encode())
        won, responses = self._txn(
            "create", [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": 0}],
            [{"request_put": {"key": k, "value": _b64(_bytes(value))}}], [{"request_range": {"key": k}}])
        if won:
            return _bytes(value)
        kvs = responses[0].get("response_range", {}).get("kvs", []) if responses else []
        if not kvs:  # a key deleted (delete_prefix) between the compare and now cannot happen in one txn
            raise StoreUnavailable(f"coordination store {self.describe()}: create {key!r}: etcd returned no value")
        return _value(kvs[0])

    def add(self, key: str, amount: int) -> int:
        """A compare-and-swap loop on the key's mod_revision; the value is the decimal text, as in TCPStore.

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
        self._session.close()
