"""The admin JSON API behind the dashboard (/admin/api/*), operators only.

- GET /admin/api/overview                  live per-cloud and per-site load, health, latency
- GET /admin/api/readiness                 /readyz's report: database, sites, drains, request
                                           log, predictors
- GET /admin/api/stream                    the overview as server-sent events, about 1/s
- GET /admin/api/history?window_s&step_s&site    token load etc. per cloud (or one site)
- GET /admin/api/drift?window_s&step_s&site      predicted vs actual completion tokens
- GET /admin/api/offloads?window_s&limit&site    recent offload events
- GET /admin/api/sites/{name}?window_s&step_s    one site: now, history, drift, offloads
- POST /admin/api/sites/{name}/drain             the site takes nothing new; its queue moves
- POST /admin/api/sites/{name}/undrain           the site takes new requests again
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator
from typing import Annotated, Any, TypeVar

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, Parameter
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from gateway.admin.dashboard import Dashboard, WindowError
from gateway.admin.drain import DrainView, SiteDrainer
from gateway.admin.readiness import Readiness
from gateway.api.admin_auth import require_admin
from gateway.api.openai_errors import OpenAIError, invalid_request
from gateway.stores.load_history import Window

T = TypeVar("T")
_GZIP_MIN_BYTES = 1024
# A stream ends after this long and the browser's EventSource reconnects at once: an open
# dashboard never holds up a graceful shutdown for longer than that.
STREAM_S = 15.0
STREAM_EVERY_S = 1.0

WindowS = Annotated[int, Parameter(ge=60, description="seconds of history, up to the retention")]
StepS = Annotated[int | None, Parameter(ge=1, description="bucket width in seconds")]
SiteName = Annotated[str | None, Parameter(description="one site instead of every cloud")]
Limit = Annotated[int, Parameter(ge=1, le=1000)]


def json_response(request: Request[Any, Any, Any], value: object) -> Response[bytes]:
    """JSON, gzip-compressed when the client accepts it and it is worth it."""
    body = msgspec.json.encode(value)
    headers = {"Cache-Control": "no-store", "Vary": "Accept-Encoding"}
    if len(body) >= _GZIP_MIN_BYTES and "gzip" in request.headers.get("accept-encoding", ""):
        body = gzip.compress(body, compresslevel=5)
        headers["Content-Encoding"] = "gzip"
    return Response(body, media_type="application/json", headers=headers)


def site_found(value: T | None, site: str) -> T:
    """`value`, or a 404 naming the site: every lookup here is None for a site it does not know."""
    if value is None:
        raise OpenAIError(404, f"no site named {site!r}", param="site", code="site_not_found")
    return value


def window_of(dashboard: Dashboard, window_s: int, step_s: int | None) -> Window:
    try:
        return dashboard.window(window_s, step_s)
    except WindowError as exc:
        raise invalid_request(str(exc), param="window_s") from exc


AnyRequest = Request[Any, Any, Any]


class AdminApiController(Controller):
    path = "/api"
    tags = ("admin",)
    guards = [require_admin]  # noqa: RUF012 (litestar's)

    @get("/overview", summary="Live load per cloud and site")
    async def overview(
        self, request: AnyRequest, dashboard: NamedDependency[Dashboard]
    ) -> Response[bytes]:
        return json_response(request, await dashboard.overview())

    @get(
        "/readiness",
        summary="What /readyz judges on: the database, each site's health, the drains, the "
        "request log's backlog, the predictors' versions",
    )
    async def readiness(
        self, request: AnyRequest, readiness: NamedDependency[Readiness]
    ) -> Response[bytes]:
        return json_response(request, await readiness.report())

    @get("/stream", summary="The overview as server-sent events (event: overview)")
    async def stream(self, dashboard: NamedDependency[Dashboard]) -> ServerSentEvent:

        async def events() -> AsyncIterator[ServerSentEventMessage]:
            loop = asyncio.get_running_loop()
            ends = loop.time() + STREAM_S
            while loop.time() < ends:
                snapshot = msgspec.json.encode(await dashboard.overview()).decode()
                yield ServerSentEventMessage(data=snapshot, event="overview")
                await asyncio.sleep(STREAM_EVERY_S)

        return ServerSentEvent(events(), retry_duration=500, headers={"Cache-Control": "no-store"})

    @get("/history", summary="Load history per cloud, or of one site")
    async def history(
        self,
        request: AnyRequest,
        dashboard: NamedDependency[Dashboard],
        window_s: WindowS = 86400,
        step_s: StepS = None,
        site: SiteName = None,
    ) -> Response[bytes]:
        window = window_of(dashboard, window_s, step_s)
        history = await dashboard.history(window, site)
        return json_response(request, site_found(history, site or ""))

    @get("/drift", summary="Predicted vs actual completion tokens over time, per site and model")
    async def drift(
        self,
        request: AnyRequest,
        dashboard: NamedDependency[Dashboard],
        window_s: WindowS = 86400,
        step_s: StepS = None,
        site: SiteName = None,
        series: Annotated[bool, Parameter(description="false: the summary only")] = True,
    ) -> Response[bytes]:
        window = window_of(dashboard, window_s, step_s)
        drift = await dashboard.drift(window, site, series)
        return json_response(request, site_found(drift, site or ""))

    @get("/offloads", summary="Recent offload events")
    async def offloads(
        self,
        request: AnyRequest,
        dashboard: NamedDependency[Dashboard],
        window_s: WindowS = 86400,
        limit: Limit = 50,
        site: SiteName = None,
    ) -> Response[bytes]:
        window_of(dashboard, window_s, None)  # 400 past the retention, not an overflow
        return json_response(request, await dashboard.offloads(window_s, limit, site))

    @get("/sites/{name:str}", summary="One site: live load, history, drift and offloads")
    async def site(
        self,
        request: AnyRequest,
        dashboard: NamedDependency[Dashboard],
        name: FromPath[str],
        window_s: WindowS = 86400,
        step_s: StepS = None,
        limit: Limit = 20,
    ) -> Response[bytes]:
        window = window_of(dashboard, window_s, step_s)
        detail = await dashboard.site_detail(name, window, limit)
        return json_response(request, site_found(detail, name))

    @post("/sites/{name:str}/drain", status_code=200, summary="Drain a site (see README)")
    async def drain_site(
        self, drainer: NamedDependency[SiteDrainer], name: FromPath[str]
    ) -> DrainView:
        return site_found(await drainer.drain(name), name)

    @post("/sites/{name:str}/undrain", status_code=200, summary="End a site's drain")
    async def undrain_site(
        self, drainer: NamedDependency[SiteDrainer], name: FromPath[str]
    ) -> DrainView:
        return site_found(await drainer.undrain(name), name)
