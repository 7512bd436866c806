"""Replication transport: moves verified files between node supervisors over authenticated HTTP.

It knows no checkpoint layout; the replicator (:mod:`supervisor.tiers.replication`) decides what to send.

- :mod:`.auth`: shared secret (``load_secret``) and the HMAC-SHA256 request signature scheme.
- :mod:`.store`: ``ReplicaStore``, verified files under ``root/<namespace>/<relpath>``.
- :mod:`.server`: ``ReplicationServer`` (aiohttp in a background thread).
- :mod:`.client`: ``PeerClient`` (sync API), ``BandwidthLimiter``, ``TransferPool``, ``TransportError``.
- :mod:`.http11`: the one HTTP/1.1 answer reader (status line, headers, Content-Length, chunks, limits),
  shared with the etcd gateway client (:mod:`supervisor.cluster.etcd_http`).
"""

from supervisor.transport.auth import SecretError, load_secret, write_secret
from supervisor.transport.client import BandwidthLimiter, PeerClient, TransferPool, TransportError
from supervisor.transport.server import ReplicationServer
from supervisor.transport.store import IntegrityError, InvalidPath, NotFound, ReplicaStore, StoreError

__all__ = [
    "BandwidthLimiter", "IntegrityError", "InvalidPath", "NotFound", "PeerClient", "ReplicaStore",
    "ReplicationServer", "SecretError", "StoreError", "TransferPool", "TransportError", "load_secret",
    "write_secret",
]
