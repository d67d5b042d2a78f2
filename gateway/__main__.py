"""Runs the gateway: `python -m gateway` (settings from GATEWAY_* environment variables)."""

from __future__ import annotations

import uvicorn

from gateway.app import create_app
from gateway.log_setup import configure_logging
from gateway.settings import GatewaySettings


def main() -> None:
    settings = GatewaySettings.from_env()
    app = create_app(settings)
    configure_logging(settings)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,
    )


if __name__ == "__main__":
    main()
