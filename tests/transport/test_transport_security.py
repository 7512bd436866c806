"""The transport's credentials as one record (supervisor/transport/security.py): the shared secret, read through
one rule, and the endpoint's TLS, which a peer's client accepts by the CA alone (peers are addressed by IP)."""

from __future__ import annotations

import datetime
import socket
import ssl
import threading
from pathlib import Path

import pytest

from supervisor.config import SupervisorConfig
from supervisor.transport.auth import SecretError
from supervisor.transport.security import TransportSecurity


def test_the_record_is_built_from_the_config_keys() -> None:
    cfg = SupervisorConfig(token_file="/t", tls_cert="/c", tls_key="/k", tls_ca="/ca")
    assert TransportSecurity.from_config(cfg) == TransportSecurity("/t", "/c", "/k", "/ca")


def test_no_token_file_is_refused_naming_the_key() -> None:
    with pytest.raises(SecretError, match="key 'token_file': replication between nodes needs a shared secret file"):
        TransportSecurity().secret()


def test_the_secret_is_read_from_the_token_file(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_bytes(b"0123456789abcdef0123\n")
    token.chmod(0o600)
    assert TransportSecurity(str(token)).secret() == b"0123456789abcdef0123"
    token.chmod(0o644)
    with pytest.raises(SecretError, match="chmod 600"):  # load_secret's own checks still apply
        TransportSecurity(str(token)).secret()


def test_without_a_certificate_both_sides_speak_plain_http() -> None:
    plain = TransportSecurity("/t")
    assert plain.server_context() is None and plain.client_context() is None


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (its own CA) and its key, as PEM files."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rlsup-test-node")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "node.pem", tmp_path / "node.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> None:
    """One TLS handshake between the two contexts over a socket pair; raises the client's error."""
    a, b = socket.socketpair()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            with server.wrap_socket(a, server_side=True) as s:
                s.sendall(b"ok")
        except (ssl.SSLError, OSError) as e:
            errors.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with client.wrap_socket(b, server_hostname="10.0.0.9") as c:  # a peer named by an address not in the cert
            assert c.recv(2) == b"ok"
    finally:
        thread.join(10)
        a.close()
        b.close()


def test_a_peer_with_the_cas_certificate_is_accepted_by_address(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    security = TransportSecurity("/t", str(cert), str(key), str(cert))
    server, client = security.server_context(), security.client_context()
    assert server is not None and client is not None
    assert client.verify_mode == ssl.CERT_REQUIRED and not client.check_hostname
    _handshake(server, client)


def test_a_peer_whose_certificate_another_ca_signed_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cert, key = _self_signed(tmp_path / "a")
    other_ca, _ = _self_signed(tmp_path / "b")
    server = TransportSecurity("/t", str(cert), str(key)).server_context()
    client = TransportSecurity("/t", str(other_ca), str(key), str(other_ca)).client_context()
    assert server is not None and client is not None
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(server, client)
