"""Throwaway certificate authorities for tests: a CA, a server and a client certificate, as PEM
files (EC P-256, valid for a day), made with `cryptography`; docs/security.md shows the same with
openssl for real deployments."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True, slots=True)
class TestPki:
    """One CA and the two leaf certificates it signed, each with its key file."""

    __test__ = False  # not a test class, despite its name

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    # Further client certificates of the same CA by common name (cert, key): not the gateway's.
    other_clients: dict[str, tuple[Path, Path]] = field(default_factory=dict)

    def site_env(self) -> dict[str, str]:
        return {
            "SITE_TLS_CERT": str(self.server_cert),
            "SITE_TLS_KEY": str(self.server_key),
            "SITE_TLS_CLIENT_CA": str(self.ca_cert),
        }

    def gateway_env(self) -> dict[str, str]:
        return {
            "GATEWAY_SITE_TLS_CA": str(self.ca_cert),
            "GATEWAY_SITE_TLS_CERT": str(self.client_cert),
            "GATEWAY_SITE_TLS_KEY": str(self.client_key),
        }


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedllm tests"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None) -> None:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )


def _issue(
    subject: str,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    extensions: list[tuple[x509.ExtensionType, bool]],
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, signing_key = (
        (issuer[0].subject, issuer[1]) if issuer is not None else (_name(subject), key)
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(signing_key, hashes.SHA256()), key


def make_pki(
    directory: Path,
    *,
    ca_name: str = "fedllm test CA",
    server_dns: tuple[str, ...] = ("localhost",),
    server_ips: tuple[str, ...] = ("127.0.0.1",),
    other_clients: tuple[str, ...] = (),
) -> TestPki:
    """A fresh CA in `directory` (created), with a server certificate for `server_dns` and
    `server_ips`, a client certificate for the gateway (`fedllm-gateway`), and one more client
    certificate for each name of `other_clients` (another site's, say)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = _issue(
        ca_name,
        None,
        [
            (x509.BasicConstraints(ca=True, path_length=0), True),
            (
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                True,
            ),
        ],
    )
    alt_names: list[x509.GeneralName] = [x509.DNSName(name) for name in server_dns]
    alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
    leaf = (x509.BasicConstraints(ca=False, path_length=None), True)
    server = _issue(
        server_dns[0] if server_dns else "site",
        ca,
        [
            leaf,
            (x509.SubjectAlternativeName(alt_names), False),
            (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False),
        ],
    )
    client = _issue(
        "fedllm-gateway",
        ca,
        [leaf, (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)],
    )
    _write(directory / "ca", ca[0], None)
    _write(directory / "server", *server)
    _write(directory / "client", *client)
    others: dict[str, tuple[Path, Path]] = {}
    for number, name in enumerate(other_clients):
        client_auth = (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)
        _write(directory / f"other-{number}", *_issue(name, ca, [leaf, client_auth]))
        others[name] = (directory / f"other-{number}.crt", directory / f"other-{number}.key")
    return TestPki(
        ca_cert=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
        other_clients=others,
    )
