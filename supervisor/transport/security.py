"""How a job's nodes prove themselves to each other: the shared secret's file and the endpoint's TLS, one record.

Every user of the secret (the replication service, the coordination store's signed keys, a refusing node's
notice) reads it through :meth:`TransportSecurity.secret`, so a missing ``token_file`` is refused in one
place with one message; the TLS contexts of the endpoint and of its clients are built here alone.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING

from supervisor.transport.auth import SecretError, load_secret

if TYPE_CHECKING:
    from supervisor.config import SupervisorConfig


@dataclass(frozen=True)
class TransportSecurity:
    """The ``token_file`` and ``tls_*`` keys. No ``tls_cert``: plain HTTP, every request still signed (HMAC)."""

    token_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""  # empty: the system's CA bundle

    @classmethod
    def from_config(cls, cfg: "SupervisorConfig") -> "TransportSecurity":
        return cls(cfg.token_file, cfg.tls_cert, cfg.tls_key, cfg.tls_ca)

    def secret(self) -> bytes:
        """The job's shared secret; :class:`SecretError` naming the key or the file when there is none to use."""
        if not self.token_file:
            raise SecretError("key 'token_file': replication between nodes needs a shared secret file")
        return load_secret(self.token_file)

    def server_context(self) -> ssl.SSLContext | None:
        """The endpoint's TLS (None: plain HTTP)."""
        if not self.tls_cert:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx

    def client_context(self) -> ssl.SSLContext | None:
        """A peer client's TLS (None: plain HTTP), peers' certificates checked against ``tls_ca``."""
        if not self.tls_cert:
            return None
        ctx = ssl.create_default_context(cafile=self.tls_ca or None)
        ctx.check_hostname = False  # peers are addressed by IP or short host name; the CA pins identity
        return ctx


__all__ = ["TransportSecurity"]
