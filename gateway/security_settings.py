"""Who may reach the gateway and how it reaches the sites: groups of GatewaySettings
(GATEWAY_ADMIN_*, GATEWAY_REQUIRE_API_KEYS, GATEWAY_ALLOW_OPEN_ACCESS, GATEWAY_SITE_TLS_*); see
docs/security.md.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from fedllm_contract.env_settings import (
    SettingsError,
    require_positive,
    setting,
    variable,
)


@dataclass(frozen=True, slots=True)
class AdminSettings:
    ENV_PREFIX: ClassVar[str] = "GATEWAY_ADMIN_"

    token: str | None = setting(
        None,
        help="the operator credential (16+ characters) for `/admin`, the admin API and "
        "`/metrics`; unset: they refuse everyone",
    )
    metrics_token: str | None = setting(
        None,
        help="a read-only credential (16+ characters, not the admin token) that opens "
        "`/metrics` and nothing else: what Prometheus scrapes with (deploy/k8s), so the "
        "scraper never holds the admin token; unset: `/metrics` takes the admin credential only",
    )
    session_ttl_s: float = setting(
        12 * 3600.0,
        help="a dashboard sign-in ends this long after it began, checked on the server (the "
        "session row, table `admin_sessions`, is also revoked by `Log out` on every gateway of "
        "the database)",
    )

    def __post_init__(self) -> None:
        require_positive(self, "session_ttl_s")
        if self.token is not None and len(self.token) < 16:
            raise SettingsError("GATEWAY_ADMIN_TOKEN must be at least 16 characters")
        if self.metrics_token is not None:
            if len(self.metrics_token) < 16:
                raise SettingsError("GATEWAY_ADMIN_METRICS_TOKEN must be at least 16 characters")
            if self.metrics_token == self.token:
                # One credential both ways would make the read-only one an admin credential.
                raise SettingsError(
                    "GATEWAY_ADMIN_METRICS_TOKEN must differ from GATEWAY_ADMIN_TOKEN"
                )


@dataclass(frozen=True, slots=True)
class AccessSettings:
    """Who may use the client APIs (docs/security.md)."""

    ENV_PREFIX: ClassVar[str] = "GATEWAY_"

    require_api_keys: bool = setting(
        False,
        shown_default="`true` unless `GATEWAY_HOST` is loopback",
        help="client APIs answer 401 without a live API key (needs `GATEWAY_ADMIN_TOKEN`, keys "
        "are made through the admin API); see API keys. On a non-loopback host, `false` needs "
        "`GATEWAY_ALLOW_OPEN_ACCESS`",
    )
    allow_open_access: bool = setting(
        False,
        help="the explicit override to serve a non-loopback address without keys (logged as a "
        "WARNING at start); without it such a gateway requires keys, or refuses to start "
        "without `GATEWAY_ADMIN_TOKEN`",
    )
    trusted_proxies: str = setting(
        "",
        shown_default="(none)",
        help="comma-separated addresses or CIDR networks of the proxies in front of the gateway "
        "whose `X-Forwarded-For` and `X-Forwarded-Proto` name the client (the admin guessing "
        "throttle counts that client); none by default: the headers are ignored from everyone, "
        "loopback included",
    )

    def __post_init__(self) -> None:
        self.proxy_networks()  # refuses what is not an address or a network, at start

    def proxy_networks(self) -> tuple[str, ...]:
        """GATEWAY_TRUSTED_PROXIES, each an address or network in its normal form."""
        networks = []
        for entry in filter(None, (part.strip() for part in self.trusted_proxies.split(","))):
            try:
                networks.append(str(ipaddress.ip_network(entry, strict=False)))
            except ValueError as exc:
                raise SettingsError(
                    f"GATEWAY_TRUSTED_PROXIES: {entry!r} is not an IP address or CIDR network"
                ) from exc
        return tuple(networks)


@dataclass(frozen=True, slots=True)
class SiteTlsSettings:
    """Mutual TLS to the sites (gateway/sites/tls.py): all three or none (none: plaintext)."""

    ENV_PREFIX: ClassVar[str] = "GATEWAY_SITE_TLS_"

    ca: Path | None = setting(
        None,
        help="mutual TLS to the sites: the PEM CA that signs site certificates (all three "
        "`GATEWAY_SITE_TLS_*` or none; none: plaintext). A site's `tls_server_name` in the "
        "federation file names its certificate when the endpoint is an IP; see "
        "[security.md](security.md)",
    )
    cert: Path | None = setting(None, help="this gateway's PEM client certificate")
    key: Path | None = setting(None, help="its private key")

    def __post_init__(self) -> None:
        tls = {variable(type(self), name): getattr(self, name) for name in ("ca", "cert", "key")}
        if any(tls.values()) and not all(tls.values()):
            missing = [name for name, path in tls.items() if path is None]
            raise SettingsError(f"TLS needs all of {list(tls)} or none; missing {missing}")
