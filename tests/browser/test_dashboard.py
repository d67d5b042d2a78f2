"""The admin dashboard in a real headless Chromium against a gateway with three live sites:
log in, watch per-cloud token load rise under traffic and drain after, drill into a site, and
check that every number shown equals the admin API's. A gateway minutes old: its headline chart
covers the history there is (not an empty window), and its legend shows the latest values
before any hover (it showed "–" until hovered)."""

from __future__ import annotations

import threading
import time
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page

from tests.browser.charts import EMPTY, chart, hover_then_leave
from tests.e2e.conftest import Federation, wait_until_written
from tests.e2e.test_prediction_http import (  # a small real predictor; requests that vary
    artifact,  # noqa: F401
    send_varied,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]
TOKEN = "browser-test-admin-token-42"
SITES = ["aws-use1", "gcp-euw4", "azure-jpe"]
FLOATS = {"requests_per_min": 2, "ttft_ms": 1, "e2e_ms": 1}

COLLECT = """() => {
  const fields = (root) => Object.fromEntries(
    [...root.querySelectorAll('[data-field]')].map((n) => [n.dataset.field, n.textContent]));
  const by = (sel, key) => Object.fromEntries(
    [...document.querySelectorAll(sel)].map((n) => [n.dataset[key], fields(n)]));
  const detail = document.querySelector('#detail-stats');
  return {
    at: Number(document.querySelector('#clouds').dataset.at),
    sitesAt: Number(document.querySelector('#sites tbody').dataset.at),
    detailAt: detail.dataset.at ? Number(detail.dataset.at) : null,
    clouds: by('#clouds [data-cloud]', 'cloud'),
    sites: by('#sites tbody tr[data-site]', 'site'),
    detail: fields(detail),
  };
}"""


def shown(field: str, value: Any) -> str:
    """How the page formats an API value (the page must not compute, only format)."""
    if value is None:
        return "–"
    if field in FLOATS:
        return f"{value:.{FLOATS[field]}f}"
    if field == "prefix_cache_hit_rate":
        return f"{100 * value:.1f}%"
    return f"{value:,}"


@pytest.fixture(scope="module")
def federation(start_federation, artifact: Path) -> Federation:  # noqa: F811
    return start_federation(
        live=SITES,
        env={
            "GATEWAY_ADMIN_TOKEN": TOKEN,
            "GATEWAY_LOAD_SAMPLE_INTERVAL_S": "0.5",
            "GATEWAY_PREDICTOR_DIR": str(artifact),
            "GATEWAY_ROUTING_POLICY": "least_tokens",
            "GATEWAY_LOAD_REPORT_INTERVAL_MS": "100",
            # The tiny model's answers all stop at max_tokens: count them in the drift window.
            "GATEWAY_DRIFT_INCLUDE_CENSORED": "true",
            "GATEWAY_DRIFT_MIN_SAMPLES": "10",
            "GATEWAY_DRIFT_REFRESH_S": "0.5",
        },
    )


class Traffic:
    """Streams long completions from a few threads until stopped."""

    def __init__(self, base_url: str, workers: int = 6) -> None:
        self._stop = threading.Event()
        self.sent = 0
        self.errors: list[str] = []
        self._threads = [
            threading.Thread(target=self._loop, args=(base_url, i)) for i in range(workers)
        ]

    def _loop(self, base_url: str, worker: int) -> None:
        with httpx.Client(base_url=base_url, timeout=120) as client:
            while not self._stop.is_set():
                body = {
                    "model": "tiny",
                    "prompt": f"worker {worker} request {self.sent}",
                    "max_tokens": 192,
                    "ignore_eos": True,
                }
                response = client.post("/v1/completions", json=body)
                if response.status_code != 200:
                    self.errors.append(response.text)
                self.sent += 1

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)


def api(federation: Federation, path: str, **params: Any) -> Any:
    response = httpx.get(
        f"{federation.base_url}{path}",
        params=params,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )
    response.raise_for_status()
    return response.json()


def cloud_loads(page: Page) -> dict[str, int]:
    texts = page.eval_on_selector_all(
        "#clouds [data-cloud]",
        "cards => cards.map(c => [c.dataset.cloud, "
        "c.querySelector('[data-field=token_load]').textContent])",
    )
    return {cloud: int(text.replace(",", "")) for cloud, text in texts}


def assert_page_matches_overview(page: Page, federation: Federation, detail: str | None) -> None:
    """Reads the page and the API until both show the same snapshot, then compares every value."""
    for _ in range(60):
        seen = page.evaluate(COLLECT)
        overview = api(federation, "/admin/api/overview")
        same = seen["at"] == seen["sitesAt"] == overview["at"]
        if same and (detail is None or seen["detailAt"] == overview["at"]):
            break
        time.sleep(0.2)
    else:
        pytest.fail("the page never showed the API's current snapshot")
    assert sorted(seen["clouds"]) == sorted(c["cloud"] for c in overview["clouds"])
    for cloud in overview["clouds"]:
        texts = seen["clouds"][cloud["cloud"]]
        for field, text in texts.items():
            assert text == shown(field, cloud[field]), (cloud["cloud"], field)
    for site in overview["sites"]:
        texts = seen["sites"][site["name"]]
        assert texts["healthy"] == ("healthy" if site["healthy"] else "down")
        assert texts["kind"] == (
            "OpenAI API · no offload release" if site["kind"] == "openai" else "gRPC engine"
        )
        for field, text in texts.items():
            if field not in ("healthy", "cloud", "model", "kind"):
                assert text == shown(field, site[field]), (site["name"], field)
        if site["name"] == detail:
            for field, text in seen["detail"].items():
                if field not in ("healthy", "completed_window"):
                    assert text == shown(field, site[field]), ("detail", field)


def test_dashboard_live_drilldown_and_values(
    page: Page, federation: Federation, artifacts_dir: Path
) -> None:
    page.goto(f"{federation.base_url}/admin")
    assert page.url.endswith("/admin/login")  # no credential: the login page
    page.fill("#token", "not-the-admin-token")
    page.click("button[type=submit]")
    assert page.locator(".error").inner_text() == "Wrong admin token."
    page.fill("#token", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_selector("html[data-ready=true]", timeout=15_000)
    assert page.url.endswith("/admin")
    assert page.locator(".asset-error").count() == 0
    assert page.locator("#cloud-chart canvas").count() == 1  # uPlot drew the headline chart
    assert page.inner_text("#policy") == "routing: least_tokens"
    assert set(cloud_loads(page)) == {"aws", "gcp", "azure"}
    # A gateway minutes old opens on the window that shows its history, not an hour's sliver,
    # and its chart starts where the history does, not at the window's empty start.
    assert page.input_value("#window") == "900"
    assert "15 min" in page.inner_text("#drift-scope")
    assert_chart_fits_the_history(page, federation)
    assert_legend_shows_the_latest_values(page)
    # No sample yet: the figures are not judged (the page said "ok" whatever they were).
    verdict = page.locator('#predictors tbody [data-field="drifted"]').text_content()
    assert verdict == "not judged"

    peaks: dict[str, int] = dict.fromkeys(cloud_loads(page), 0)
    with Traffic(federation.base_url) as traffic:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and min(peaks.values()) == 0:
            for cloud, load in cloud_loads(page).items():
                peaks[cloud] = max(peaks[cloud], load)
            time.sleep(0.2)
        page.screenshot(path=str(artifacts_dir / "dashboard-under-load.png"), full_page=True)
        assert_legend_shows_the_latest_values(page)  # live values, not only zeros
        hovered = hover_then_leave(page, "#cloud-chart")
        assert hovered.time not in EMPTY  # the cursor's bucket
        assert set(chart(page, "#cloud-chart").legend.values()).isdisjoint(EMPTY)  # and after
    assert not traffic.errors
    assert min(peaks.values()) > 0, f"token load never rose on every cloud: {peaks}"
    # The headline chart grew live points without a reload.
    points = page.evaluate("() => Number(document.querySelector('#cloud-chart').dataset.points)")
    assert points > 0
    # Load drains once the traffic stops, and the page follows.
    page.wait_for_function(
        "() => [...document.querySelectorAll('#clouds [data-field=token_load]')]"
        ".every(n => n.textContent === '0')",
        timeout=60_000,
    )
    time.sleep(1.5)  # the sampler's next rows count the last completions

    page.click("#sites tr[data-site=gcp-euw4]")
    page.wait_for_selector("#detail[data-loaded=true][data-site=gcp-euw4]")
    assert page.inner_text("#detail-title") == "gcp-euw4"
    assert page.locator("#detail canvas").count() == 4
    assert_page_matches_overview(page, federation, detail="gcp-euw4")

    window_s = int(page.input_value("#window"))
    detail = api(federation, "/admin/api/sites/gcp-euw4", window_s=window_s)
    completed = sum(v or 0 for v in detail["history"]["series"][0]["completed"])
    assert completed > 0
    shown_completed = page.inner_text("#detail-stats [data-field=completed_window]")
    assert shown_completed == shown("completed", completed)

    # Prediction error per site: the table refreshes by itself and matches the API.
    deadline = time.monotonic() + 30
    while True:
        drift = api(federation, "/admin/api/drift", window_s=window_s)["summary"]
        assert {row["site"] for row in drift} == set(SITES)
        rows = page.eval_on_selector_all(
            "#drift tbody tr[data-site]",
            "rows => rows.map(r => [r.dataset.site, Object.fromEntries([...r.querySelectorAll("
            "'[data-field]')].map(n => [n.dataset.field, n.textContent]))])",
        )
        expected = [
            [row["site"], {f: shown(f, row[f]) for f in ("count",)} | {
                f: to_fixed(row[f], 1) for f in ("mean_predicted", "mean_actual", "bias", "mae")
            }]
            for row in drift
        ]  # fmt: skip
        if rows == expected or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert rows == expected

    page.screenshot(path=str(artifacts_dir / "dashboard.png"), full_page=True)

    page.click("text=Log out")
    page.wait_for_url("**/admin/login")
    status = page.evaluate("() => fetch('/admin/api/overview').then(r => r.status)")
    assert status == 401


def assert_chart_fits_the_history(page: Page, federation: Federation) -> None:
    overview = api(federation, "/admin/api/overview")
    step = api(federation, "/admin/api/history", window_s=900)["step_s"]
    drawn = chart(page, "#cloud-chart")
    age = overview["at"] - overview["history_since"]
    assert age < 900 / 4, "the gateway is not young: this check needs a young one"
    # From the first bucket holding history (it starts at most a step before) to now, a minute
    # at least.
    first = overview["history_since"] - step
    assert drawn.x_min >= min(first, drawn.x_max - 60), (drawn, overview)
    assert drawn.x_max - drawn.x_min <= max(age + 3 * step, 60), (drawn, age)
    assert "history since" in page.inner_text("#cloud-span")
    # One line per cloud, told apart by their dash pattern as well as their colour.
    assert len(drawn.dashes) == len(drawn.legend) == 3


def assert_legend_shows_the_latest_values(page: Page) -> None:
    """The legend, the cursor away, shows each cloud's latest value: once the first live point
    is drawn, the value on its card (both from the same snapshot)."""
    deadline = time.monotonic() + 10
    while True:
        legend = chart(page, "#cloud-chart").legend
        assert set(legend) == {"aws", "gcp", "azure"}
        assert set(legend.values()).isdisjoint(EMPTY), legend
        cards = cloud_loads(page)
        if {cloud: int(text.replace(",", "")) for cloud, text in legend.items()} == cards:
            return
        assert time.monotonic() < deadline, (legend, cards)
        time.sleep(0.2)


def to_fixed(value: float, digits: int) -> str:
    """JavaScript's Number.prototype.toFixed: the exact binary value, ties away from zero
    (Python's format rounds ties to even: 14.25 is "14.3" on the page and "14.2" in Python)."""
    exact = Decimal(value).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP)
    return f"{exact:.{digits}f}"


def settle_rolling_error(federation: Federation, at_least: int) -> None:
    """Waits until the rolling error counts `at_least` samples and stops moving: every answer
    written, then the same count over more than one refresh (GATEWAY_DRIFT_REFRESH_S = 0.5 s),
    so the page and a later API read see the same snapshot."""
    wait_until_written(federation.base_url)
    deadline = time.monotonic() + 20
    last = -1
    while True:
        rolling = api(federation, "/admin/api/predictors")["models"][0]["rolling"] or {}
        samples = int(rolling.get("samples", 0))
        if samples >= at_least and samples == last:
            return
        assert time.monotonic() < deadline, f"the rolling error still moves ({last} -> {samples})"
        last = samples
        time.sleep(0.8)


def test_predictor_drift_panel_shows_the_apis_numbers(federation: Federation, page: Page) -> None:
    """The drift panel lists the served model with the rolling error the admin API reports."""
    send_varied(federation.base_url, 24)
    settle_rolling_error(federation, at_least=24)
    page.goto(f"{federation.base_url}/admin/login")
    page.fill("#token", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_selector("html[data-ready=true]", timeout=15_000)
    (model,) = api(federation, "/admin/api/predictors")["models"]  # no traffic now: it holds
    name = model["model"]
    row = page.locator(f'#predictors tbody tr[data-model="{name}"]')
    cells = {
        field: row.locator(f'[data-field="{field}"]').text_content()
        for field in ("samples", "mae_tokens", "served_mean_mae_tokens", "mae_ratio", "spearman",
                      "drifted", "version")
    }  # fmt: skip
    rolling = model["rolling"]
    assert cells == {
        "samples": str(rolling["samples"]),
        "mae_tokens": to_fixed(rolling["mae_tokens"], 1),
        "served_mean_mae_tokens": to_fixed(rolling["served_mean_mae_tokens"], 1),
        "mae_ratio": to_fixed(rolling["mae_ratio"], 2) if rolling["mae_ratio"] is not None else "–",
        "spearman": to_fixed(rolling["spearman"], 3),
        "drifted": model["verdict"],
        "version": model["window_version"],
    }


def test_capacity_panel_shows_sites_joining_and_leaving(federation: Federation, page: Page) -> None:
    """A site an operator joins and removes through the admin API: one line per event in the
    capacity panel, as GET /admin/api/scaling lists them (this gateway has no scaling file)."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    entry = {"name": "extra-site", "cloud": "gcp", "region": "us-central1", "model": "tiny",
             "endpoint": "127.0.0.1:9"}  # fmt: skip
    with httpx.Client(base_url=federation.base_url, headers=headers, timeout=10) as client:
        assert client.post("/admin/api/sites", json=entry).status_code == 201
        assert client.delete("/admin/api/sites/extra-site").status_code == 202
        for _ in range(100):  # nothing runs there: it leaves at once
            if "extra-site" not in api(federation, "/admin/api/readiness")["sites"]:
                break
            time.sleep(0.1)
    page.goto(f"{federation.base_url}/admin/login")
    page.fill("#token", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_selector("html[data-ready=true]", timeout=15_000)
    scaling = api(federation, "/admin/api/scaling")
    assert not scaling["enabled"]
    assert [e["action"] for e in scaling["events"]] == ["leave", "drain", "join"]
    rows = page.locator("#scaling-events tbody tr")
    assert rows.count() == 3
    shown_events = [
        (rows.nth(i).get_attribute("data-action"),
         rows.nth(i).locator('[data-field="site"]').text_content(),
         rows.nth(i).locator('[data-field="actor"]').text_content())
        for i in range(3)
    ]  # fmt: skip
    assert shown_events == [(e["action"], e["site"], e["actor"]) for e in scaling["events"]]
    state = page.locator("#scaling-state").text_content() or ""
    assert state.startswith("no scaling file")
