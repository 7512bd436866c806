"""Shared-secret loading and the HMAC request signature: unit checks, then over real HTTP."""

from __future__ import annotations

import http.client
import os
import time
from pathlib import Path

import pytest

from supervisor.transport.auth import (H_AUTH, H_NONCE, H_TIMESTAMP, SecretError, Verifier, auth_headers,
                                       load_secret, write_secret)
from supervisor.transport.client import PeerClient, TransportError
from supervisor.transport.server import ReplicationServer
from supervisor.transport.store import ReplicaStore

SECRET = b"0123456789abcdef0123456789abcdef"


# ------------------------------------------------------------ load_secret

def _token(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def test_load_secret_ok_strips_whitespace(tmp_path: Path) -> None:
    p = _token(tmp_path / "tok", b"  " + SECRET + b"\n")
    assert load_secret(p) == SECRET


def test_write_secret_roundtrip(tmp_path: Path) -> None:
    p = tmp_path / "tok"
    s = write_secret(p)
    assert (p.stat().st_mode & 0o777) == 0o600
    assert load_secret(p) == s and len(s) == 64


def test_load_secret_missing_names_file(tmp_path: Path) -> None:
    p = tmp_path / "nope"
    with pytest.raises(SecretError, match=f"{p}.*does not exist"):
        load_secret(p)


def test_load_secret_empty(tmp_path: Path) -> None:
    p = _token(tmp_path / "tok", b"\n \n")
    with pytest.raises(SecretError, match=f"{p}.*empty"):
        load_secret(p)


def test_load_secret_too_short(tmp_path: Path) -> None:
    p = _token(tmp_path / "tok", b"short")
    with pytest.raises(SecretError, match="at least 16"):
        load_secret(p)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_load_secret_refuses_group_or_world_readable(tmp_path: Path, mode: int) -> None:
    p = _token(tmp_path / "tok", SECRET, mode)
    with pytest.raises(SecretError, match=f"chmod 600 {p}"):
        load_secret(p)


def test_load_secret_not_a_file(tmp_path: Path) -> None:
    d = tmp_path / "dir"
    d.mkdir(mode=0o700)
    with pytest.raises(SecretError, match=f"{d}.*not a regular file"):
        load_secret(d)


def test_load_secret_unreadable(tmp_path: Path) -> None:
    p = _token(tmp_path / "tok", SECRET, 0o000)
    if os.access(p, os.R_OK):  # root reads anything; the mode check still applies to 0o000
        assert load_secret(p) == SECRET
    else:
        with pytest.raises(SecretError, match=f"{p}.*cannot read"):
            load_secret(p)


# ------------------------------------------------------------ Verifier

def _verify(v: Verifier, method: str, path: str, headers: dict, now: float | None = None) -> int:
    return v.verify(method, path, headers, now=now).status


def test_verifier_accepts_and_rejects_tampering() -> None:
    v = Verifier(SECRET)
    h = auth_headers(SECRET, "PUT", "/v1/files/n/a", 10, "ab" * 16)
    assert _verify(v, "PUT", "/v1/files/n/a", h) == 200
    for method, path, change in [
        ("GET", "/v1/files/n/a", {}),
        ("PUT", "/v1/files/n/b", {}),
        ("PUT", "/v1/files/n/a", {"Content-Length": "11"}),
        ("PUT", "/v1/files/n/a", {"X-Rlsup-Xxh3": "cd" * 16}),
    ]:
        h2 = auth_headers(SECRET, "PUT", "/v1/files/n/a", 10, "ab" * 16)
        h2.update(change)
        assert _verify(v, method, path, h2) == 403, (method, path, change)


def test_verifier_missing_and_malformed_are_401() -> None:
    v = Verifier(SECRET)
    good = auth_headers(SECRET, "GET", "/v1/health")
    for drop in (H_AUTH, H_NONCE, H_TIMESTAMP):
        h = {k: x for k, x in good.items() if k != drop}
        assert _verify(v, "GET", "/v1/health", h) == 401
    for key, bad in [(H_AUTH, "Basic abc"), (H_AUTH, "RLSUP-HMAC-SHA256 xyz"), (H_TIMESTAMP, "soon"),
                     (H_NONCE, "short"), (H_NONCE, "bad nonce with spaces!!")]:
        assert _verify(v, "GET", "/v1/health", {**good, key: bad}) == 401


def test_verifier_wrong_secret_403() -> None:
    h = auth_headers(b"another-secret-of-32-bytes-xxxxx", "GET", "/v1/health")
    assert _verify(Verifier(SECRET), "GET", "/v1/health", h) == 403


def test_verifier_replay_and_skew() -> None:
    v = Verifier(SECRET)
    h = auth_headers(SECRET, "GET", "/v1/health")
    assert _verify(v, "GET", "/v1/health", h) == 200
    assert v.verify("GET", "/v1/health", h).reason == "replayed nonce"
    now = time.time()
    for skew in (-301, 301):
        hs = auth_headers(SECRET, "GET", "/v1/health", now=now + skew)
        assert _verify(v, "GET", "/v1/health", hs, now=now) == 403
    for skew in (-299, 299):
        hs = auth_headers(SECRET, "GET", "/v1/health", now=now + skew)
        assert _verify(v, "GET", "/v1/health", hs, now=now) == 200


def test_verifier_nonce_cache_bounded_without_reopening_replays() -> None:
    v = Verifier(SECRET, max_nonces=4)
    now = time.time()
    first = auth_headers(SECRET, "GET", "/v1/health", now=now - 10)
    assert _verify(v, "GET", "/v1/health", first, now=now) == 200
    for i in range(6):
        h = auth_headers(SECRET, "GET", "/v1/health", now=now - 5 + i)
        assert _verify(v, "GET", "/v1/health", h, now=now) == 200
    assert len(v._nonces) <= 4
    # The first nonce was evicted, but its timestamp is now below the floor: still refused.
    assert v.verify("GET", "/v1/health", first, now=now).reason.startswith("timestamp at or below")
    assert _verify(v, "GET", "/v1/health", auth_headers(SECRET, "GET", "/v1/health", now=now + 1), now=now) == 200


# ------------------------------------------------------------ over HTTP

@pytest.fixture
def server(tmp_path: Path):
    srv = ReplicationServer(ReplicaStore(tmp_path / "store"), SECRET)
    srv.start()
    yield srv
    srv.stop()


def _raw(port: int, method: str, path: str, headers: dict) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_http_unauthenticated_401(server: ReplicationServer) -> None:
    assert _raw(server.port, "GET", "/v1/health", {}) == 401
    assert _raw(server.port, "GET", "/v1/index/node0", {}) == 401
    assert _raw(server.port, "GET", "/no/such/route", {}) == 401  # nothing is revealed before auth


def test_http_bad_signature_403(server: ReplicationServer) -> None:
    client = PeerClient(f"127.0.0.1:{server.port}", b"wrong-secret-wrong-secret-wrong!", retries=0)
    with pytest.raises(TransportError) as ei:
        client.health()
    assert ei.value.status == 403 and ei.value.peer == f"127.0.0.1:{server.port}"
    client.close()


def test_http_replay_and_stale_refused(server: ReplicationServer) -> None:
    h = auth_headers(SECRET, "GET", "/v1/health")
    assert _raw(server.port, "GET", "/v1/health", h) == 200
    assert _raw(server.port, "GET", "/v1/health", h) == 403
    stale = auth_headers(SECRET, "GET", "/v1/health", now=time.time() - 400)
    assert _raw(server.port, "GET", "/v1/health", stale) == 403
    ok = PeerClient(f"127.0.0.1:{server.port}", SECRET)
    assert ok.health()["ok"] is True
    ok.close()
