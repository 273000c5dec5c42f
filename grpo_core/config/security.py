"""The ``tls`` section: TLS of the listeners a run starts (docs/security.md)."""

from __future__ import annotations

from pathlib import Path

from pydantic import model_validator

from grpo_core.config.base import _Strict
from grpo_core.errors import ConfigError


class TLSConfig(_Strict):
    """TLS of the listeners the run starts: the generation servers (embedded and vLLM), the router and the rollout's
    Arrow Flight server serve HTTPS / ``grpc+tls`` with ``cert_file`` and ``key_file``, and the run's clients of them
    verify the certificate against ``ca_file``. Off (plain HTTP and ``grpc``) while ``cert_file`` is unset: keep
    the listeners on loopback then (a listener bound beyond loopback without TLS logs a warning naming this section).
    The files are read where each listener and client runs (on several hosts: the same paths on each); the
    certificate must name every host the listeners are reached by (subject alternative names)."""

    cert_file: Path | None = None
    """PEM certificate (chain) the listeners present; None = no TLS."""
    key_file: Path | None = None
    """PEM private key of ``cert_file`` (unencrypted; keep it 0600)."""
    ca_file: Path | None = None
    """PEM CA certificate(s) the run's clients verify an ``https://`` / ``grpc+tls://`` server against: the
    listeners above, and external servers of ``server.urls`` (set alone for those); None = the system's trusted CAs
    (a certificate from a public CA)."""

    @model_validator(mode="after")
    def _check_pair(self) -> TLSConfig:
        if (self.cert_file is None) != (self.key_file is None):
            given, missing = ("cert_file", "key_file") if self.cert_file is not None else ("key_file", "cert_file")
            raise ConfigError(f"tls.{given} is set but tls.{missing} is not: give both (the certificate and its key)")
        return self

    @property
    def enabled(self) -> bool:
        """Whether the listeners serve TLS."""
        return self.cert_file is not None

    def client_ca(self) -> str | None:
        """The CA file clients verify against, as a string (None = the system's CAs)."""
        return str(self.ca_file) if self.ca_file is not None else None
