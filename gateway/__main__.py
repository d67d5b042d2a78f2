"""Runs the gateway: `python -m gateway` (settings from GATEWAY_* environment variables)."""

from __future__ import annotations

import gc
import logging

import uvicorn

from gateway.api.http_protocol import bounded_protocol
from gateway.app import create_app
from gateway.log_setup import configure_logging
from gateway.settings import GatewaySettings, is_loopback

log = logging.getLogger("gateway")


def main() -> None:
    settings = GatewaySettings.from_env()
    app = create_app(settings)
    configure_logging(settings)
    if not (settings.access.require_api_keys or is_loopback(settings.server.host)):
        log.warning(
            "OPEN ACCESS: GATEWAY_ALLOW_OPEN_ACCESS=true and %s is not loopback: anyone who "
            "reaches this port is served without an API key, outside every key's limits",
            settings.server.host,
        )
    # The modules and the app live as long as the process: out of the collector's sight, they cost
    # nothing in its collections while serving (each full one would walk them all) or at exit.
    gc.collect()
    gc.freeze()
    uvicorn.run(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_level=settings.server.log_level.lower(),
        access_log=False,
        # uvloop and httptools: the event loop and HTTP parser in C, a fifth of the gateway's
        # CPU per request less than asyncio's loop with h11 (bench/results/gateway_overhead.md).
        loop="uvloop",
        http=bounded_protocol(settings.limits),
        # Idle connections (new ones too, gateway/api/http_protocol.py) close after this long.
        timeout_keep_alive=settings.limits.keep_alive_timeout_s,
    )


if __name__ == "__main__":
    main()
