"""The admin dashboard over real HTTP: every page and API needs the admin credential, login sets
a hardened session cookie (and nothing on a wrong token), the sampler fills the history, and the
API answers with downsampled, gzip-compressed series."""

from __future__ import annotations

import time

import httpx
import pytest

from gateway.api.admin_auth import ADMIN_COOKIE, new_session_id, session_cookie
from tests.e2e.conftest import Federation

pytestmark = pytest.mark.slow
TOKEN = "dashboard-test-token-0123456789"
API_PATHS = [
    "/admin/api/overview",
    "/admin/api/stream",
    "/admin/api/history",
    "/admin/api/drift",
    "/admin/api/offloads",
    "/admin/api/readiness",
    "/admin/api/sites/aws-use1",
]


@pytest.fixture(scope="module")
def federation(start_federation) -> Federation:
    return start_federation(
        live=["aws-use1", "gcp-euw4"],
        dead=("azure-jpe",),
        env={"GATEWAY_ADMIN_TOKEN": TOKEN, "GATEWAY_LOAD_SAMPLE_INTERVAL_S": "0.3"},
    )


def test_dashboard_and_admin_api_need_the_credential(federation: Federation) -> None:
    with httpx.Client(base_url=federation.base_url, timeout=10) as client:
        page = client.get("/admin", follow_redirects=False)
        assert page.status_code == 303
        assert page.headers["location"] == "/admin/login"
        for path in API_PATHS:
            assert client.get(path).status_code == 401, path
        # Wrong tokens, from an address of their own: the sixth wrong one in a minute waits.
        guessing = httpx.HTTPTransport(local_address="127.0.0.31")
        with httpx.Client(base_url=federation.base_url, transport=guessing) as guesser:
            wrong = [
                guesser.get(path, headers={"Authorization": "Bearer not-the-token-at-all"})
                for path in API_PATHS
            ]
        assert [w.status_code for w in wrong] == [401] * 5 + [429] * (len(API_PATHS) - 5)
        assert {w.json()["error"]["code"] for w in wrong[:5]} == {"admin_credential_required"}
        forged = session_cookie("another-token-entirely", new_session_id(), int(time.time()))
        for cookie in (forged, "nope"):
            with httpx.Client(base_url=federation.base_url, cookies={ADMIN_COOKIE: cookie}) as c:
                assert c.get("/admin/api/overview").status_code == 401
                assert c.get("/admin", follow_redirects=False).status_code == 303
        # The login page and the static assets are public; they hold nothing secret.
        assert client.get("/admin/login").status_code == 200
        assert client.get("/admin/static/dashboard.js").status_code == 200

        bearer = {"Authorization": f"Bearer {TOKEN}"}
        for path in API_PATHS[:1] + API_PATHS[2:]:
            assert client.get(path, headers=bearer).status_code == 200, path
        assert client.get("/admin", headers=bearer).status_code == 200


def test_login_sets_a_hardened_cookie_and_logout_clears_it(federation: Federation) -> None:
    with httpx.Client(base_url=federation.base_url, timeout=10) as client:
        wrong = client.post("/admin/login", data={"token": "wrong-token-wrong-token"})
        assert wrong.status_code == 401
        assert "set-cookie" not in wrong.headers
        assert "Wrong admin token" in wrong.text

        ok = client.post("/admin/login", data={"token": TOKEN}, follow_redirects=False)
        assert ok.status_code == 303
        assert ok.headers["location"] == "/admin"
        cookie = ok.headers["set-cookie"]
        assert cookie.startswith(f"{ADMIN_COOKIE}=")
        assert "HttpOnly" in cookie
        assert "samesite=strict" in cookie.lower()
        assert "Secure" not in cookie  # plain http on loopback; https sets it
        assert TOKEN not in cookie

        page = client.get("/admin")
        assert page.status_code == 200
        assert '<div id="cloud-chart"' in page.text
        assert "asset-error" not in page.text  # uPlot is installed and served
        assert client.get("/admin/api/overview").status_code == 200

        out = client.post("/admin/logout", follow_redirects=False)
        assert out.status_code == 303
        assert out.headers["set-cookie"].startswith(f"{ADMIN_COOKIE}=")
        assert ADMIN_COOKIE not in client.cookies  # expired: the client dropped it
        assert client.get("/admin/api/overview").status_code == 401


def test_history_is_sampled_downsampled_and_compressed(federation: Federation) -> None:
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=federation.base_url, timeout=30, headers=bearer) as client:
        for i in range(4):
            body = {"model": "tiny", "prompt": f"hello {i}", "max_tokens": 8}
            # Client traffic carries no admin token (it would be taken for an API key).
            sent = httpx.post(f"{federation.base_url}/v1/completions", json=body, timeout=30)
            assert sent.status_code == 200
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            sampled = federation.query(
                "SELECT COALESCE(SUM(completed_requests), 0), COUNT(DISTINCT site_id) "
                "FROM load_samples"
            )[0]
            if sampled[0] == 4:
                break
            time.sleep(0.3)
        assert sampled == (4, 3)  # every finished request counted once; dead sites sampled too

        # The overview is rebuilt at most once a second (shared by every viewer): an earlier
        # test's snapshot may still be served for up to that long.
        deadline = time.monotonic() + 5
        while True:
            overview = client.get("/admin/api/overview").json()
            recent = sum(c["completed_recent"] for c in overview["clouds"])
            if recent == 4 or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert [c["cloud"] for c in overview["clouds"]] == ["aws", "azure", "gcp"]
        assert {s["name"]: s["healthy"] for s in overview["sites"]} == {
            "aws-use1": True,
            "azure-jpe": False,
            "gcp-euw4": True,
        }
        assert recent == 4
        assert overview["policy"]["routing"] == "round_robin"

        history = client.get("/admin/api/history", params={"window_s": 3600, "step_s": 60})
        assert history.headers.get("content-encoding") == "gzip"  # httpx decoded it for us
        h = history.json()
        assert (h["step_s"], h["points"]) in {(60, 60), (60, 61)}
        assert {s["key"] for s in h["series"]} == {"aws", "azure", "gcp"}
        assert sum(sum(v or 0 for v in s["completed"]) for s in h["series"]) == 4
        assert all(len(s["token_load"]) == h["points"] for s in h["series"])

        site = client.get("/admin/api/sites/gcp-euw4", params={"window_s": 3600}).json()
        assert site["site"]["name"] == "gcp-euw4"
        assert [s["key"] for s in site["history"]["series"]] == ["gcp-euw4"]

        assert client.get("/admin/api/sites/nowhere").status_code == 404
        too_fine = client.get("/admin/api/history", params={"window_s": 86400, "step_s": 1})
        assert too_fine.status_code == 400

        raw = httpx.get(
            f"{federation.base_url}/admin/static/uPlot.iife.min.js",
            headers={"Accept-Encoding": "gzip"},
        )
        assert raw.headers["content-encoding"] == "gzip"
        assert b"uPlot" in raw.content  # httpx undid the gzip
