"""The job's namespace in the coordination store: signed keys, and what ``abort`` says.

Every key lives under ``rlsup/<job>/`` and every value is signed with the job's shared secret
(HMAC-SHA256 over key, job, writer, time and payload): a value another job wrote, or one a writer
without the secret forged, is ignored and named in the log (:mod:`supervisor.cluster.coordinator`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass
from enum import Enum

from supervisor.job_identity import JobIdentity
from supervisor.cluster.kvstore import KVStore

log = logging.getLogger(__name__)


class AbortKind(str, Enum):
    """Why the job gave up, as its nodes' exit codes tell the scheduler."""

    GAVE_UP = "gave_up"  # a node gave up (its restarts exhausted, a timeout): exit 1
    CLASH = "clash"  # a node refused to start for a clash with another job: exit 2, as it did
    PEER_LOST = "peer_lost"  # a node died before the job's first attempt (supervisor.cluster.liveness): exit 75


@dataclass(frozen=True)
class AbortNotice:
    """What ``abort`` says: why the job gave up, and how (:class:`AbortKind`): a node that refused to start
    for a clash with another job (its peers then exit as it did, 2), or one lost before the first attempt."""

    why: str
    kind: AbortKind = AbortKind.GAVE_UP

    @property
    def clash(self) -> bool:
        return self.kind is AbortKind.CLASH

    def to_payload(self) -> str:
        """A plain reason, or a record: ``{"why", "clash": true}`` (as rlsup has always written it) or
        ``{"why", "kind"}``; a node of an older version reads a kind it does not know as a plain reason."""
        if self.kind is AbortKind.GAVE_UP:
            return self.why
        if self.clash:
            return json.dumps({"why": self.why, "clash": True})
        return json.dumps({"why": self.why, "kind": self.kind.value})

    @classmethod
    def from_payload(cls, payload: str) -> "AbortNotice":
        """A plain reason (a node gave up), or a record; anything else is a plain reason."""
        try:
            d = json.loads(payload)
        except ValueError:
            return cls(payload)
        if isinstance(d, dict) and isinstance(d.get("why"), str):
            if d.get("clash"):
                return cls(d["why"], AbortKind.CLASH)
            try:
                return cls(d["why"], AbortKind(d.get("kind", AbortKind.GAVE_UP.value)))
            except ValueError:
                return cls(d["why"])
        return cls(payload)


@dataclass(frozen=True)
class Signed:
    """A verified value: who wrote it, when, and what."""

    job: str
    node: int
    time: float
    payload: str


class SignedKeys:
    """The job's namespace in a store: keys under ``rlsup/<job>/``, values signed with the job's secret."""

    def __init__(self, store: KVStore, job: JobIdentity, secret: bytes, node_rank: int) -> None:
        self.store, self.job, self.secret, self.node_rank = store, job, secret, node_rank
        self.prefix = f"rlsup/{job.id}/"
        self._warned: set[str] = set()

    def key(self, name: str) -> str:
        return self.prefix + name

    def seal(self, full_key: str, payload: str) -> bytes:
        body = json.dumps({"job": self.job.id, "node": self.node_rank, "time": time.time(), "v": payload})
        mac = hmac.new(self.secret, full_key.encode() + b"\0" + body.encode(), hashlib.sha256).hexdigest()
        return f"{mac}:{body}".encode()

    def open(self, full_key: str, raw: bytes | None, quiet: bool = False) -> Signed | None:
        """The verified value, or None (absent, or written by someone without this job's secret)."""
        if raw is None:
            return None
        try:
            mac, _, body = raw.decode().partition(":")
            good = hmac.compare_digest(
                mac, hmac.new(self.secret, full_key.encode() + b"\0" + body.encode(), hashlib.sha256).hexdigest())
            d = json.loads(body) if good else None
            if d is not None and d.get("job") == self.job.id:
                return Signed(str(d["job"]), int(d["node"]), float(d["time"]), str(d["v"]))
        except (UnicodeDecodeError, ValueError, KeyError, TypeError):
            pass
        if not quiet and full_key not in self._warned:
            self._warned.add(full_key)
            try:
                claim = json.loads(raw.decode().partition(":")[2])
                who = f" (it claims job {claim.get('job')!r}, node {claim.get('node')!r})"
            except (UnicodeDecodeError, ValueError, AttributeError):
                who = ""
            log.warning("ignored %s: not signed by this job's secret (a foreign or stale writer)%s", full_key, who)
        return None

    def set(self, name: str, payload: str) -> None:
        k = self.key(name)
        self.store.set(k, self.seal(k, payload))

    def get(self, name: str) -> Signed | None:
        k = self.key(name)
        return self.open(k, self.store.get(k))

    def get_many(self, names: list[str]) -> list[Signed | None]:
        keys = [self.key(n) for n in names]
        return [self.open(k, raw) for k, raw in zip(keys, self.store.get_many(keys))]

    def poll(self, names: list[str], other: str | None) -> tuple[list[Signed | None] | None, Signed | None]:
        """:meth:`KVStore.poll`, verified: every value (None where it does not verify) once all exist, else
        ``other``'s."""
        keys = [self.key(n) for n in names]
        other_key = self.key(other) if other is not None else None
        values, other_raw = self.store.poll(keys, other_key)
        if values is not None:
            return [self.open(k, raw) for k, raw in zip(keys, values)], None
        return None, self.open(other_key, other_raw) if other_key is not None else None

    def create(self, name: str, payload: str) -> Signed:
        """First signed writer wins; an unsigned squatter is overwritten (it cannot hold a key against us)."""
        k = self.key(name)
        sealed = self.seal(k, payload)
        current = self.open(k, self.store.create(k, sealed))
        if current is None:
            self.store.set(k, sealed)
            current = self.open(k, sealed)
        assert current is not None
        return current


__all__ = ["AbortKind", "AbortNotice", "Signed", "SignedKeys"]
