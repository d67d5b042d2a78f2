"""Container health probe: `python -m site_engine.healthcheck [--port N] [--host H]`.

Asks the local engine's standard gRPC health service (grpc.health.v1) whether the server is
SERVING and exits 0 if so, 1 otherwise (down, starting, or shutting down). The port defaults to
the engine's own setting (SITE_PORT), so the image's HEALTHCHECK needs no arguments. Imports no
torch: it runs every 30 seconds next to a busy engine.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from site_engine.settings import SettingsError, SiteSettings

# The empty service name is the whole server's status (the engine sets it with its own).
_SERVER = ""


def probe(target: str, timeout_s: float) -> bool:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=_SERVER), timeout=timeout_s)
        except grpc.RpcError:
            return False
    serving: bool = response.status == health_pb2.HealthCheckResponse.SERVING
    return serving


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m site_engine.healthcheck", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=None, help="default: SITE_PORT")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    args = parser.parse_args(argv)
    port = args.port
    if port is None:
        try:
            port = SiteSettings.load().port
        except SettingsError as exc:
            print(f"unhealthy: the engine's settings are invalid: {exc}", file=sys.stderr)
            return 1
    if probe(f"{args.host}:{port}", args.timeout):
        return 0
    print(f"unhealthy: no SERVING answer from {args.host}:{port}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
