"""The site's TLS credentials: its certificate and key, and the CA its clients must be signed by.

A site with TLS accepts only clients that present a certificate from that CA (mutual TLS): the
gateway is the only legitimate caller, and anyone who can reach the port must not be able to
generate, cancel or drain work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc

from fedllm_contract.pem import read_pem as read_contract_pem
from site_engine.settings import SettingsError, SiteSettings


@dataclass(frozen=True, slots=True)
class ServerTls:
    certificate_chain: bytes
    # Kept out of the repr so that the key cannot reach a log or a traceback through it.
    private_key: bytes = field(repr=False)
    client_ca: bytes

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.certificate_chain)],
            root_certificates=self.client_ca,
            require_client_auth=True,
        )


def read_pem(variable: str, path: Path, marker: str) -> bytes:
    """A PEM file named by a SITE_* setting (or a healthcheck flag), refused as a SettingsError."""
    return read_contract_pem(variable, path, marker, SettingsError)


def load_server_tls(settings: SiteSettings) -> ServerTls | None:
    """The files named by SITE_TLS_* (settings checked all three or none); None: plaintext."""
    if settings.tls_cert is None or settings.tls_key is None or settings.tls_client_ca is None:
        return None
    return ServerTls(
        certificate_chain=read_pem("SITE_TLS_CERT", settings.tls_cert, "CERTIFICATE"),
        private_key=read_pem("SITE_TLS_KEY", settings.tls_key, "PRIVATE KEY"),
        client_ca=read_pem("SITE_TLS_CLIENT_CA", settings.tls_client_ca, "CERTIFICATE"),
    )
