"""Sites joining and leaving at run time, and the scaling controller's view (operators only).

- POST /admin/api/sites                   a site joins (body: a site entry as the federation
                                          file writes it); 201 with its membership
- DELETE /admin/api/sites/{name}          the site leaves by draining; 202 (its queued work
                                          moves, its running work finishes, then it goes)
- GET /admin/api/scaling?window_s&limit   each scaled model's capacity now and recent events
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Annotated, Any, TypeVar

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, Parameter

from gateway.admin.membership import MemberView, SiteMembership
from gateway.api.admin_auth import require_admin
from gateway.api.admin_routes import json_response, site_found
from gateway.api.openai_errors import invalid_request
from gateway.db.models import utcnow
from gateway.scaling.controller import ScalingController

AnyRequest = Request[Any, Any, Any]
ViewT = TypeVar("ViewT", bound=msgspec.Struct)


class VerdictView(msgspec.Struct, frozen=True):
    """A scaling verdict's numbers, as an event recorded them or a model's capacity is now."""

    serving_sites: int
    desired_sites: int
    backlog_s: float | None
    forecast_backlog_s: float | None
    reason: str
    arrival_rate: float | None = None
    lead_s: float | None = None
    smoothed_backlog_s: float | None = None


class ScalingEventView(VerdictView, frozen=True, kw_only=True):
    at: float
    model: str
    action: str
    actor: str
    site: str | None


class ModelCapacityView(VerdictView, frozen=True, kw_only=True):
    model: str
    actuator: str
    min_sites: int
    max_sites: int
    target_backlog_s: float
    pending_sites: int


class ScalingView(msgspec.Struct, frozen=True):
    enabled: bool
    models: list[ModelCapacityView]
    leaving: list[str]
    events: list[ScalingEventView]


def _round(value: float | None) -> float | None:
    return round(value, 3) if value is not None and math.isfinite(value) else None


def _view(struct: type[ViewT], source: object, **given: object) -> ViewT:
    """`struct` with each field `given` or else `source`'s attribute of its name, floats read
    from `source` rounded to a millisecond's precision (None where not finite: JSON has no inf)."""
    values: dict[str, object] = {}
    for name in struct.__struct_fields__:
        value = given[name] if name in given else getattr(source, name)
        values[name] = _round(value) if isinstance(value, float) and name not in given else value
    return struct(**values)


class AdminSitesController(Controller):
    path = "/api"
    tags = ("admin",)
    guards = [require_admin]  # noqa: RUF012 (litestar's)

    @post("/sites", status_code=201, summary="A site joins at run time (docs/elastic.md)")
    async def join_site(
        self, request: AnyRequest, membership: NamedDependency[SiteMembership]
    ) -> MemberView:
        config = membership.parse(await request.body())
        if config.openai is not None and config.openai.api_key_file is not None:
            # A file path from the admin API would let an admin credential read the gateway
            # host's files (sent as the engine's key): such sites go in the federation file.
            raise invalid_request(
                "a site joining through the admin API cannot name an api_key_file; list it in "
                "the federation file", param="api_key_file",
            )  # fmt: skip
        site = await membership.join(config, "operator")
        return membership.view(site)

    @delete("/sites/{name:str}", status_code=202, summary="A site leaves by draining")
    async def leave_site(
        self, membership: NamedDependency[SiteMembership], name: FromPath[str]
    ) -> Response[MemberView]:
        site_found(membership.leave(name, "operator", "an operator removed it"), name)
        site = membership.site(name)
        view = membership.view(site) if site is not None else None
        gone = MemberView(name, "", "operator", False, True, False, 0)
        return Response(view or gone, status_code=202)

    @get("/scaling", summary="Each scaled model's capacity now, and recent scaling events")
    async def scaling(
        self,
        request: AnyRequest,
        membership: NamedDependency[SiteMembership],
        scaling: NamedDependency[ScalingController | None],
        window_s: Annotated[int, Parameter(ge=60, le=30 * 86400)] = 3600,
        limit: Annotated[int, Parameter(ge=1, le=1000)] = 100,
    ) -> Response[bytes]:
        since = utcnow() - timedelta(seconds=window_s)
        rows = await membership.events(since, limit)
        views = scaling.views() if scaling is not None else []
        return json_response(
            request,
            ScalingView(
                enabled=scaling is not None,
                models=[
                    _view(
                        ModelCapacityView,
                        v,
                        target_backlog_s=v.target_backlog_s,
                        smoothed_backlog_s=_round(v.level_s),
                    )
                    for v in views
                ],
                leaving=membership.leaving(),
                events=[
                    _view(ScalingEventView, row, at=round(row.at.timestamp(), 3)) for row in rows
                ],
            ),
        )
