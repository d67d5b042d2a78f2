"""The dashboard's charts at every history window the page offers, in a real headless Chromium,
with the sampler at its default 10 s and a day of history behind it: the headline chart and the
drill-down's load, rate and latency charts draw lines at each window (at 15 minutes they were
blank: 4 s buckets, a sample every 10 s, every point alone between gaps). The page loads without
a console error or a failed request (the favicon was a 404). Screenshots of each window go to
test-artifacts/dashboard-windows/; `FEDLLM_DOC_IMAGES=1` writes them to docs/img/ instead, the
pictures of docs/dashboard.md (a plain `make test` leaves the checkout as it was).

One long prompt five minutes ago (a sample 30x the day's load) set the headline chart's scale and
flattened everything else (issue 48): where it stands out, the scale now stops short of it and the
chart says so; where it does not (a bucket of 5 minutes averages it away) nothing is clipped.
Every legend shows its series' latest values before any hover.
"""

from __future__ import annotations

import asyncio
import math
import os
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page
from sqlalchemy import insert

from gateway.db.migrate import upgrade
from gateway.db.models import LoadSample
from gateway.db.session import create_engine, create_sessionmaker
from gateway.federation import SiteConfig
from gateway.stores.site_store import sync_sites
from tests.browser.charts import EMPTY, chart, hover_then_leave
from tests.e2e.conftest import SITE_PLACES, Federation

pytestmark = [pytest.mark.browser, pytest.mark.slow]
TOKEN = "browser-windows-admin-token-42"
SITES = ["aws-use1", "gcp-euw4", "azure-jpe"]
ROOT = Path(__file__).resolve().parents[2]
IMAGES = (
    ROOT / "docs" / "img"
    if os.environ.get("FEDLLM_DOC_IMAGES") == "1"
    else ROOT / "test-artifacts" / "dashboard-windows"
)
HISTORY_S, SAMPLE_S = 86400 + 600, 10
# History runs on past the fixture's start, over the minutes the sites and the gateway take to
# start and the test takes to run: no bucket of a window is left between the two.
AHEAD_S = 600
# The drill-down's charts that history alone fills (the fourth, prediction error, needs
# requests with predictions: tests/browser/test_dashboard.py covers it).
LOAD_CHARTS = ("#detail-tokens", "#detail-rate", "#detail-latency")
LABELS = {900: "15min", 3600: "1h", 21600: "6h", 86400: "24h"}
# One long prompt's sample, OUTLIER_AGO_S before the fixture's start, on one site of one cloud.
OUTLIER_SITE, OUTLIER_AGO_S, OUTLIER_TOKENS = "aws-use1", 302.5, 60_000
# The windows whose buckets (20 s) leave the outlier standing out, and one that averages it away.
CLIPPED, UNCLIPPED = (900, 3600), (86400,)


async def write_history(database_url: str) -> None:
    """A day of load samples, one per site every 10 s (and a little jitter), as the sampler
    writes them (its rows; load rises and falls over the day and the half hour), in the database
    the gateway opens."""
    engine = create_engine(database_url)
    try:
        sessions = create_sessionmaker(engine)
        configs = tuple(
            SiteConfig(name, *SITE_PLACES[name], "127.0.0.1:1", "tiny") for name in SITES
        )
        site_ids = await sync_sites(sessions, configs)
        now = datetime.now(UTC)
        rows = []
        for step in range((HISTORY_S + AHEAD_S) // SAMPLE_S):
            at = now - timedelta(seconds=HISTORY_S - step * SAMPLE_S + 0.37 * (step % 3))
            for phase, name in enumerate(SITES):
                seconds = step * SAMPLE_S
                day = math.sin(2 * math.pi * seconds / 86400 + phase)
                wave = 1 + 0.6 * day + 0.3 * math.sin(2 * math.pi * seconds / 1800 + phase)
                rows.append(
                    {
                        "site_id": site_ids[name],
                        "bucket_at": at,
                        "queued_tokens": int(300 * wave),
                        "running_tokens": int(900 * wave),
                        "predicted_remaining_tokens": int(500 * wave),
                        "queued_requests": int(2 * wave),
                        "running_requests": int(6 * wave),
                        "completed_requests": round(2 + 2 * wave),
                        "ttft_mean_ms": 40 + 20 * wave,
                        "ttft_p50_ms": 35 + 20 * wave,
                        "e2e_mean_ms": 900 + 300 * wave,
                        "e2e_p50_ms": 850 + 300 * wave,
                        "healthy": True,
                    }
                )
        rows.append(
            {
                **rows[-1],
                "site_id": site_ids[OUTLIER_SITE],
                "bucket_at": now - timedelta(seconds=OUTLIER_AGO_S),
                "queued_tokens": OUTLIER_TOKENS,
            }
        )
        async with sessions.begin() as session:
            await session.execute(insert(LoadSample), rows)
    finally:
        await engine.dispose()


@pytest.fixture(scope="module")
def federation(start_federation, tmp_path_factory: pytest.TempPathFactory) -> Federation:
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('history') / 'gateway.db'}"
    upgrade(url)
    # On a thread of its own: Playwright's sync API holds this thread's event loop.
    with ThreadPoolExecutor(1) as writer:
        writer.submit(asyncio.run, write_history(url)).result()
    # The sampler at its default interval (10 s), where the 15-minute window broke.
    return start_federation(live=SITES, database_url=url, env={"GATEWAY_ADMIN_TOKEN": TOKEN})


def segments(page: Page, selector: str) -> int:
    return int(page.get_attribute(selector, "data-segments") or "0")


def test_every_window_draws_every_chart(page: Page, federation: Federation) -> None:
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on(
        "response",
        lambda r: problems.append(f"{r.status} {r.url}") if r.status >= 400 else None,
    )
    page.goto(f"{federation.base_url}/admin/login")
    page.fill("#token", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_selector("html[data-ready=true]", timeout=15_000)
    windows = [
        int(v) for v in page.eval_on_selector_all("#window option", "os => os.map(o => o.value)")
    ]
    assert windows == sorted(LABELS)  # a window added to the page needs its screenshot here
    IMAGES.mkdir(parents=True, exist_ok=True)
    for window in windows:
        page.goto(f"{federation.base_url}/admin?window={window}")
        page.wait_for_selector("html[data-ready=true]", timeout=15_000)
        assert page.input_value("#window") == str(window)
        history = httpx.get(
            f"{federation.base_url}/admin/api/history",
            params={"window_s": window},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30,
        ).json()
        assert history["step_s"] >= 2 * SAMPLE_S
        # Every bucket of the window holds history (the oldest may start before it).
        for series in history["series"]:
            assert all(v is not None for v in series["token_load"][1:-1]), (window, series["key"])
        headline = segments(page, "#cloud-chart")
        assert headline >= len(SITES) * (history["points"] - 3), (window, headline)
        assert_scale_and_legend(page, window, history)

        page.click("#sites tr[data-site=gcp-euw4]")
        page.wait_for_selector("#detail[data-loaded=true][data-site=gcp-euw4]")
        for selector in LOAD_CHARTS:
            drawn = segments(page, selector)
            assert drawn >= history["points"] - 3, (window, selector, drawn)
            legend = chart(page, selector).legend
            assert legend, selector
            assert set(legend.values()).isdisjoint(EMPTY), (window, selector, legend)
        page.screenshot(path=str(IMAGES / f"dashboard-{LABELS[window]}.png"), full_page=True)
    assert problems == []


def assert_scale_and_legend(page: Page, window: int, history: dict[str, Any]) -> None:
    """The headline chart: the long prompt clipped (and said) where it stands out, nothing
    clipped where it does not; each cloud's latest value in the legend, also after a hover."""
    highest = max(v for s in history["series"] for v in s["token_load"] if v is not None)
    drawn = chart(page, "#cloud-chart")
    assert set(drawn.legend) == {"aws", "gcp", "azure"}
    assert set(drawn.legend.values()).isdisjoint(EMPTY), (window, drawn.legend)
    assert drawn.time not in EMPTY
    if window in CLIPPED:
        assert drawn.clipped >= 1, (window, drawn)
        assert drawn.y_max < highest / 3, (window, drawn.y_max, highest)
        assert drawn.note is not None
        assert "Scale clipped" in drawn.note
        page.click("#cloud-chart .scale-note button")  # the whole of it, on demand
        full = chart(page, "#cloud-chart")
        assert full.y_max >= highest
        assert full.note is not None
        assert full.note.startswith("Full scale")
        page.click("#cloud-chart .scale-note button")  # and back
        assert chart(page, "#cloud-chart").y_max == drawn.y_max
    elif window in UNCLIPPED:
        assert drawn.clipped == 0, (window, drawn)
        assert drawn.note is None
        assert drawn.y_max >= highest
    hover_then_leave(page, "#cloud-chart")
    assert set(chart(page, "#cloud-chart").legend.values()).isdisjoint(EMPTY)
