"""The gateway's side of mutual TLS to its sites: the CA that signs site certificates, and the
client certificate and key the gateway presents (GATEWAY_SITE_TLS_*).

One channel per site carries everything (generation, health checks, load reports), so one set of
credentials covers them all. Without these settings the channels are plaintext, as the embedded
demo on loopback uses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from fedllm_contract.pem import read_pem
from gateway.settings import GatewaySettings, SettingsError

ChannelOptions = Sequence[tuple[str, int | str]]


@dataclass(frozen=True, slots=True)
class SiteTls:
    root_certificates: bytes
    certificate_chain: bytes
    # Kept out of the repr so that the key cannot reach a log or a traceback through it.
    private_key: bytes = field(repr=False)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )


def _read_pem(variable: str, path: Path, marker: str) -> bytes:
    return read_pem(variable, path, marker, SettingsError)


def load_site_tls(settings: GatewaySettings) -> SiteTls | None:
    """The files named by GATEWAY_SITE_TLS_* (settings checked all three or none); None: off."""
    ca, cert, key = settings.site_tls.ca, settings.site_tls.cert, settings.site_tls.key
    if ca is None or cert is None or key is None:
        return None
    return SiteTls(
        root_certificates=_read_pem("GATEWAY_SITE_TLS_CA", ca, "CERTIFICATE"),
        certificate_chain=_read_pem("GATEWAY_SITE_TLS_CERT", cert, "CERTIFICATE"),
        private_key=_read_pem("GATEWAY_SITE_TLS_KEY", key, "PRIVATE KEY"),
    )


def open_channel(
    endpoint: str,
    tls: SiteTls | None,
    options: ChannelOptions,
    server_name: str | None = None,
) -> grpc.aio.Channel:
    """A channel to one site: TLS when configured, checking the site's certificate against
    `server_name` when given (an endpoint by IP, a certificate by DNS name), else the host."""
    if tls is None:
        return grpc.aio.insecure_channel(endpoint, options=options)
    if server_name is not None:
        options = (*options, ("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(endpoint, tls.channel_credentials(), options=options)
