"""Container health probe: `python -m site_engine.healthcheck [--port N] [--host H]`.

Asks the local engine's standard gRPC health service (grpc.health.v1) whether the server is
SERVING and exits 0 if so, 1 otherwise (down, starting, shutting down, or refusing the probe).
The port defaults to the engine's own setting (SITE_PORT), so the image's HEALTHCHECK needs no
arguments. Imports no torch: it runs every 30 seconds next to a busy engine.

With mutual TLS on (SITE_TLS_*, docs/security.md) the engine serves only TLS and admits only
clients with a certificate of its client CA, so the probe speaks TLS as such a client. By default
it presents the engine's own certificate and key (SITE_TLS_CERT, SITE_TLS_KEY: the deployment's
site certificates carry clientAuth as well as serverAuth and are signed by the same CA as the
gateway's) and checks the engine's certificate against SITE_TLS_CLIENT_CA (the one CA of the
deployment) for the first DNS name that certificate carries, since the probe dials 127.0.0.1.
--tls-ca, --tls-cert, --tls-key and --server-name override each of these, e.g. where separate
CAs sign the sites' and the gateway's certificates.
"""

from __future__ import annotations

import _ssl
import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from site_engine.settings import SettingsError, SiteSettings
from site_engine.tls import read_pem

# The empty service name is the whole server's status (the engine sets it with its own).
_SERVER = ""


@dataclass(frozen=True, slots=True)
class ProbeTls:
    """What the probe needs to be admitted by a mutual-TLS engine and to trust it."""

    root_certificates: bytes
    certificate_chain: bytes
    # Kept out of the repr so that the key cannot reach a log or a traceback through it.
    private_key: bytes = field(repr=False)
    server_name: str


def certificate_dns_names(path: Path) -> list[str]:
    """The DNS names of a PEM certificate's subjectAltName, in order (the ssl module's decoder:
    the site image has no `cryptography`)."""
    decoded = getattr(_ssl, "_test_decode_cert")(str(path))  # noqa: B009 - absent from typeshed
    return [value for kind, value in decoded.get("subjectAltName", ()) if kind == "DNS"]


def load_probe_tls(
    settings: SiteSettings,
    *,
    ca: Path | None = None,
    cert: Path | None = None,
    key: Path | None = None,
    server_name: str | None = None,
) -> ProbeTls | None:
    """None when the engine serves plaintext (no SITE_TLS_*); otherwise the probe's credentials:
    the given files, falling back to the engine's own (see the module's docstring)."""
    if settings.tls_cert is None or settings.tls_key is None or settings.tls_client_ca is None:
        return None
    ca_path, cert_path, key_path = (
        ca or settings.tls_client_ca,
        cert or settings.tls_cert,
        key or settings.tls_key,
    )
    if server_name is None:
        try:
            names = certificate_dns_names(settings.tls_cert)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise SettingsError(f"SITE_TLS_CERT: cannot decode {settings.tls_cert}: {exc}") from exc
        # Without a DNS name in it, the certificate's hostname check would fail whatever we ask:
        # the site's name is the conventional one to fall back to.
        server_name = names[0] if names else settings.site_name
    return ProbeTls(
        root_certificates=read_pem("--tls-ca / SITE_TLS_CLIENT_CA", ca_path, "CERTIFICATE"),
        certificate_chain=read_pem("--tls-cert / SITE_TLS_CERT", cert_path, "CERTIFICATE"),
        private_key=read_pem("--tls-key / SITE_TLS_KEY", key_path, "PRIVATE KEY"),
        server_name=server_name,
    )


def _channel(target: str, tls: ProbeTls | None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(target)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.root_certificates,
        private_key=tls.private_key,
        certificate_chain=tls.certificate_chain,
    )
    options = [("grpc.ssl_target_name_override", tls.server_name)]
    return grpc.secure_channel(target, credentials, options=options)


def check(target: str, timeout_s: float, tls: ProbeTls | None = None) -> tuple[bool, str]:
    """(SERVING?, why not): one Check of the whole server's health over the given transport."""
    with _channel(target, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=_SERVER), timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            return False, f"{getattr(code, 'name', 'error')}: {details}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return response.status == health_pb2.HealthCheckResponse.SERVING, status


def probe(target: str, timeout_s: float, tls: ProbeTls | None = None) -> bool:
    return check(target, timeout_s, tls)[0]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m site_engine.healthcheck",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=None, help="default: SITE_PORT")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    parser.add_argument("--tls-ca", type=Path, help="default: SITE_TLS_CLIENT_CA")
    parser.add_argument("--tls-cert", type=Path, help="default: SITE_TLS_CERT")
    parser.add_argument("--tls-key", type=Path, help="default: SITE_TLS_KEY")
    parser.add_argument(
        "--server-name", help="default: the first DNS name of the engine's certificate"
    )
    args = parser.parse_args(argv)
    try:
        # The probe needs the port and TLS settings only; the model directory is the engine's.
        settings = SiteSettings.load(model_dir="-")
        tls = load_probe_tls(
            settings,
            ca=args.tls_ca,
            cert=args.tls_cert,
            key=args.tls_key,
            server_name=args.server_name,
        )
    except SettingsError as exc:
        print(f"unhealthy: the engine's settings are invalid: {exc}", file=sys.stderr)
        return 1
    port = settings.port if args.port is None else args.port
    target = f"{args.host}:{port}"
    serving, status = check(target, args.timeout, tls)
    if serving:
        return 0
    transport = "plaintext" if tls is None else f"TLS as {tls.server_name}"
    print(f"unhealthy: no SERVING answer from {target} ({transport}): {status}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
