"""The gateway process's logging: level from GATEWAY_LOG_LEVEL, and no payloads in the logs.

What this gateway logs itself never carries API keys, the admin token or TLS key material, and
carries prompts only with GATEWAY_LOG_PROMPTS on (gateway/request_path/record.py). Libraries
are another matter: aiosqlite logs every database call at DEBUG with its SQL parameters (the
prompts of predictor samples among them), so it is held at INFO whatever the level.
"""

from __future__ import annotations

import logging

from gateway.settings import GatewaySettings

FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
_PAYLOAD_LOGGERS = ("aiosqlite",)


def configure_logging(settings: GatewaySettings) -> None:
    """Call after the app is built: Litestar configures the root logger (at INFO) when built,
    and its handler (a queue, so logging never blocks the event loop) is kept."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format=FORMAT)
    root.setLevel(settings.server.log_level)
    logging.getLogger("litestar").setLevel(settings.server.log_level)
    for name in _PAYLOAD_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.INFO, root.level))
    # httpx logs every call to an OpenAI-compatible site at INFO: its health checks and metric
    # scrapes every second would drown the gateway's own lines; their failures are logged here.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
