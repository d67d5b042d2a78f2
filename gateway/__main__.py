"""Runs the gateway: `python -m gateway` (settings from GATEWAY_* environment variables)."""

from __future__ import annotations

import logging

import uvicorn

from gateway.app import create_app
from gateway.log_setup import configure_logging
from gateway.settings import GatewaySettings, is_loopback

log = logging.getLogger("gateway")


def main() -> None:
    settings = GatewaySettings.from_env()
    app = create_app(settings)
    configure_logging(settings)
    if not (settings.require_api_keys or is_loopback(settings.host)):
        log.warning(
            "OPEN ACCESS: GATEWAY_ALLOW_OPEN_ACCESS=true and %s is not loopback: anyone who "
            "reaches this port is served without an API key, outside every key's limits",
            settings.host,
        )
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,
    )


if __name__ == "__main__":
    main()
