"""The dashboard's pages: /admin, its login and logout, and its static files.

The page itself is plain HTML and a small script; uPlot (charts) comes from the npm registry at
set-up time (`npm ci --prefix gateway/admin_ui`, part of `make setup`) and is served from here,
never from a CDN: many production networks have no internet. A missing asset is logged when the
app is built and shown on the page, rather than stopping the gateway.
"""

from __future__ import annotations

import gzip
import hashlib
import html
import logging
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from litestar import Controller, Request, Response, Router, get, post
from litestar.params import FromPath
from litestar.response import Redirect

from gateway.api.adapter_routes import AdminAdaptersController
from gateway.api.admin_auth import (
    ADMIN_COOKIE,
    DEVICE_COOKIE,
    DEVICE_TTL_S,
    admin_access,
    bearer_is_admin,
    cookie_session,
    device_cookie,
    guesser,
    is_operator,
    new_session_id,
    refuse_cross_site,
    session_cookie,
)
from gateway.api.admin_routes import AdminApiController
from gateway.api.predictor_routes import PredictorAdminController
from gateway.api.site_routes import AdminSitesController
from gateway.api.workload_routes import AdminWorkloadController
from gateway.settings import is_loopback

log = logging.getLogger(__name__)

UI_DIR = Path(__file__).resolve().parent.parent / "admin_ui"
_UPLOT = UI_DIR / "node_modules" / "uplot" / "dist"
ASSET_FILES = {
    "uPlot.iife.min.js": (_UPLOT / "uPlot.iife.min.js", "text/javascript"),
    "uPlot.min.css": (_UPLOT / "uPlot.min.css", "text/css"),
    "dashboard.js": (UI_DIR / "static" / "dashboard.js", "text/javascript"),
    # The charts' scales, legends and notes (a module dashboard.js imports).
    "charts.js": (UI_DIR / "static" / "charts.js", "text/javascript"),
    # The predictors' drift panel (a module dashboard.js imports).
    "predictors.js": (UI_DIR / "static" / "predictors.js", "text/javascript"),
    # The capacity panel: sites per model and the scaling events (a module dashboard.js imports).
    "scaling.js": (UI_DIR / "static" / "scaling.js", "text/javascript"),
    # The batches panel: open batches' progress and per-adapter load (a module dashboard.js
    # imports).
    "workload.js": (UI_DIR / "static" / "workload.js", "text/javascript"),
    # The table panels' cells (a module predictors.js, scaling.js and workload.js import).
    "table.js": (UI_DIR / "static" / "table.js", "text/javascript"),
    "dashboard.css": (UI_DIR / "static" / "dashboard.css", "text/css"),
    # Linked from both pages: without it the browser asks for /favicon.ico and logs a 404.
    "favicon.svg": (UI_DIR / "static" / "favicon.svg", "image/svg+xml"),
}
# Browsers that reached the dashboard over https keep to https for a year (ignored over http).
HSTS = {"Strict-Transport-Security": "max-age=31536000"}
AnyRequest = Request[Any, Any, Any]


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    gzipped: bytes
    media_type: str
    etag: str


@dataclass(frozen=True, slots=True)
class AdminAssets:
    files: dict[str, Asset]
    missing: list[str]
    dashboard_html: str
    login_html: str

    @classmethod
    def load(cls, ui_dir: Path = UI_DIR) -> AdminAssets:
        files, missing = {}, []
        for name, (path, media_type) in ASSET_FILES.items():
            try:
                body = path.read_bytes()
            except OSError:
                missing.append(str(path))
                continue
            etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
            files[name] = Asset(body, gzip.compress(body, compresslevel=9), media_type, etag)
        if missing:
            log.error(
                "admin dashboard assets missing (run `make setup`, which runs "
                "`npm ci --prefix gateway/admin_ui`): %s",
                ", ".join(missing),
            )
        pages = ui_dir / "pages"
        return cls(
            files,
            missing,
            (pages / "dashboard.html").read_text(),
            (pages / "login.html").read_text(),
        )

    def dashboard_page(self) -> str:
        banner = ""
        if self.missing:
            banner = (
                '<p class="asset-error" role="alert">Charts unavailable: missing '
                + html.escape(", ".join(self.missing))
                + ". Run <code>make setup</code> (it runs <code>npm ci --prefix "
                "gateway/admin_ui</code>) and restart the gateway.</p>"
            )
        return self.dashboard_html.replace("<!--ASSET_ERROR-->", banner)

    def login_page(self, error: str | None) -> str:
        text = f'<p class="error" role="alert">{html.escape(error)}</p>' if error else ""
        return self.login_html.replace("<!--ERROR-->", text)


def _html(body: str, status: int = 200, headers: dict[str, str] | None = None) -> Response[str]:
    return Response(
        body,
        status_code=status,
        media_type="text/html; charset=utf-8",
        headers={
            "Cache-Control": "no-store",
            "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff",
            **HSTS,
            **(headers or {}),
        },
    )


def admin_pages(assets: AdminAssets) -> type[Controller]:

    class AdminPages(Controller):
        path = "/"
        include_in_schema = False

        @get("/")
        async def dashboard(self, request: AnyRequest) -> Response[str] | Redirect:
            if not await is_operator(request):
                return Redirect("/admin/login", status_code=303)
            return _html(assets.dashboard_page())

        @get("/login")
        async def login_form(self) -> Response[str]:
            return _html(assets.login_page(None))

        @post("/login", status_code=303)
        async def login(self, request: AnyRequest) -> Response[str] | Redirect:
            refuse_cross_site(request, json_body=False)
            access = admin_access(request)
            admin_token = access.token
            if not admin_token:
                return _html(
                    assets.login_page("GATEWAY_ADMIN_TOKEN is not set on this gateway."), 401
                )
            # This browser's device if it signed in before, else its address.
            who, now = guesser(request, admin_token), datetime.now(UTC)
            throttle = access.login_throttle
            wait_s = await throttle.retry_after_s(who, now)
            if wait_s is not None:
                retry = str(math.ceil(wait_s))
                page = assets.login_page(f"Too many failed sign-ins; try again in {retry} s.")
                return _html(page, 429, {"Retry-After": retry})
            form = await request.form()
            token = str(form.get("token", "")).strip()
            if not token or not bearer_is_admin(admin_token, f"Bearer {token}"):
                await throttle.failed(who, now)
                return _html(assets.login_page("Wrong admin token."), 401)
            await throttle.succeeded(who)
            session_id, issued = new_session_id(), int(time.time())
            ttl_s = access.session_ttl_s
            expires = datetime.fromtimestamp(issued, UTC) + timedelta(seconds=ttl_s)
            await access.sessions.open(session_id, expires)
            response = Redirect("/admin", status_code=303, headers=HSTS)
            # Behind a load balancer the scheme seen here is http: off loopback, always.
            secure = request.url.scheme == "https" or not is_loopback(access.host)
            cookies = {
                ADMIN_COOKIE: (session_cookie(admin_token, session_id, issued), ttl_s),
                DEVICE_COOKIE: (device_cookie(admin_token, issued), DEVICE_TTL_S),
            }
            for name, (value, max_age_s) in cookies.items():
                response.set_cookie(
                    name,
                    value,
                    max_age=math.ceil(max_age_s),
                    path="/",
                    httponly=True,
                    samesite="strict",
                    secure=secure,
                )
            return response

        @post("/logout", status_code=303)
        async def logout(self, request: AnyRequest) -> Redirect:
            """Revokes the session on the server (a copy of the cookie kept elsewhere is dead
            too), then clears the browser's (the device cookie stays: it is no credential)."""
            refuse_cross_site(request, json_body=False)
            access = admin_access(request)
            admin_token = access.token
            cookie = request.cookies.get(ADMIN_COOKIE)
            ttl_s = access.session_ttl_s
            session_id = (
                cookie_session(admin_token, cookie, time.time(), ttl_s) if admin_token else None
            )
            if session_id is not None:
                await access.sessions.revoke(session_id)
            response = Redirect("/admin/login", status_code=303)
            response.delete_cookie(ADMIN_COOKIE, path="/")
            return response

        @get("/static/{name:str}")
        async def static(self, request: AnyRequest, name: FromPath[str]) -> Response[bytes]:
            asset = assets.files.get(name)
            if asset is None:
                return Response(b"not found", status_code=404, media_type="text/plain")
            headers = {"ETag": asset.etag, "Cache-Control": "no-cache", "Vary": "Accept-Encoding"}
            if request.headers.get("if-none-match") == asset.etag:
                return Response(b"", status_code=304, headers=headers)
            body = asset.body
            if "gzip" in request.headers.get("accept-encoding", ""):
                body, headers["Content-Encoding"] = asset.gzipped, "gzip"
            return Response(body, media_type=asset.media_type, headers=headers)

    return AdminPages


def admin_router() -> Router:
    """Everything under /admin: the pages (login needs no credential) and the guarded API."""
    return Router(
        path="/admin",
        route_handlers=[
            admin_pages(AdminAssets.load()),
            AdminApiController,
            AdminSitesController,
            AdminWorkloadController,
            AdminAdaptersController,
            PredictorAdminController,
        ],
    )
