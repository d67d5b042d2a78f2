"""Runs the gateway: `python -m gateway` (settings from GATEWAY_* environment variables)."""

from __future__ import annotations

import logging

import uvicorn

from gateway.app import create_app
from gateway.settings import GatewaySettings


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = GatewaySettings.from_env()
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="info",
        access_log=False,
    )


if __name__ == "__main__":
    main()
