"""Who may lend a site's KV memory and take it back (KvRoom, LendKv, ReturnKv, RenewKvLease):
the gateway alone (docs/elastic.md, "Leases"; docs/security.md).

Over mutual TLS the client's certificate must name the gateway, SITE_GATEWAY_IDENTITY (its
common name or a DNS name): the federation CA signs every site's certificate as well (each
site's health probe presents its own), so a certificate from the CA is not yet the gateway's.
Over plaintext, which a site serves only on loopback or with SITE_ALLOW_PLAINTEXT, only a caller
on loopback (or a Unix socket) may: the local actuator's gateway runs on the site's host. Anyone
else, who could otherwise shrink the site's cache or take a borrower's memory back, gets
PERMISSION_DENIED with the reason.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import unquote

# The auth context's keys (grpc's names) that carry a client certificate's names.
_NAME_KEYS = ("x509_common_name", "x509_subject_alternative_name")


def peer_is_loopback(peer: str) -> bool:
    """Whether grpc's peer string (`ipv4:127.0.0.1:5000`, `ipv6:[::1]:5000`, `unix:/path`)
    names a caller on this host's loopback or a Unix socket."""
    kind, _, rest = peer.partition(":")
    if kind in ("unix", "unix-abstract"):
        return True
    if kind not in ("ipv4", "ipv6"):
        return False
    host = unquote(rest).rsplit(":", 1)[0].strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def _over_tls(auth: Mapping[str, Iterable[bytes]]) -> bool:
    return b"ssl" in auth.get("transport_security_type", ())


@dataclass(frozen=True, slots=True)
class LendingAccess:
    """Contract: `refusal(peer, auth_context)` is None for the gateway, else why the caller may
    not lend (the PERMISSION_DENIED message)."""

    gateway_identity: str | None = None

    def refusal(self, peer: str, auth: Mapping[str, Iterable[bytes]]) -> str | None:
        if _over_tls(auth):
            if self.gateway_identity is None:
                return ("this site lends KV memory to no TLS client: SITE_GATEWAY_IDENTITY (the "
                        "gateway certificate's name) is not set")  # fmt: skip
            names = {raw.decode(errors="replace") for k in _NAME_KEYS for raw in auth.get(k, ())}
            if self.gateway_identity in names:
                return None
            return "only the gateway's certificate (SITE_GATEWAY_IDENTITY) may lend KV memory"
        if peer_is_loopback(peer):
            return None
        return ("over plaintext only a caller on loopback may lend this site's KV memory; "
                "serve mutual TLS with SITE_GATEWAY_IDENTITY for a gateway elsewhere")  # fmt: skip
