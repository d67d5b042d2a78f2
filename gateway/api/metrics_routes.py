"""GET /metrics (Prometheus text format, operators only) and the middleware that times every
HTTP request.

Prometheus scrapes with the read-only metrics credential (GATEWAY_ADMIN_METRICS_TOKEN; the
admin credential works too) as a bearer token:

    scrape_configs:
      - job_name: fedllm-gateway
        authorization: {type: Bearer, credentials_file: /etc/prometheus/gateway-metrics-token}
        static_configs: [{targets: ["gateway:8000"]}]
"""

from __future__ import annotations

import time

from litestar import Controller, Response, get
from litestar.di import NamedDependency
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.api.admin_auth import require_metrics_reader
from gateway.metrics import GatewayMetrics

UNMATCHED = "<unmatched>"  # never the raw path: that would make a series per URL


class MetricsController(Controller):
    path = "/metrics"
    tags = ("operations",)
    guards = [require_metrics_reader]  # noqa: RUF012 (litestar's)

    @get("", summary="Prometheus metrics (needs the metrics or admin credential)")
    async def metrics(self, metrics: NamedDependency[GatewayMetrics]) -> Response[bytes]:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


class HttpMetricsMiddleware:
    """Counts and times every routed HTTP request by its path template (`/v1/batches/{id}`,
    never the raw path, so the number of series stays bounded). Requests that match no route
    never reach route middleware, so they are not counted."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP:
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        metrics: GatewayMetrics = scope["litestar_app"].state.metrics
        status = 500  # what the client sees if nothing was sent before a failure
        started = time.perf_counter()

        async def timed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            route = scope.get("path_template") or UNMATCHED
            metrics.http_requests.labels(route, method, str(status)).inc()
            metrics.http_seconds.labels(route, method).observe(time.perf_counter() - started)
