"""Seeds the history, starts the gateway on it, and times /admin in headless Chromium."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from playwright.sync_api import Browser, sync_playwright

from bench.common import markdown_table, results_dir, write_results
from bench.dashboard.seed import SITES, seed
from devtools.launch import free_port, start_gateway
from gateway.api.admin_auth import ADMIN_COOKIE

CHROMIUM = "/usr/bin/chromium"
TOKEN = "bench-dashboard-admin-token"
WINDOW_S = 86_400
# Resource Timing of everything the page fetched, by kind (transferSize: headers + body as sent).
RESOURCES = """() => {
  const nav = performance.getEntriesByType('navigation')[0];
  const ready = performance.getEntriesByName('dashboard-ready')[0];
  return {
    ready_ms: ready ? ready.startTime : null,
    dom_content_loaded_ms: nav.domContentLoadedEventEnd,
    html: {transfer: nav.transferSize, decoded: nav.decodedBodySize, name: nav.name},
    resources: performance.getEntriesByType('resource').map((r) => ({
      name: r.name, transfer: r.transferSize, decoded: r.decodedBodySize,
      duration: r.duration, initiator: r.initiatorType})),
  };
}"""


def _kind(url: str) -> str:
    if "/admin/api/" in url:
        return "api_json"
    if url.endswith(".js"):
        return "js"
    if url.endswith(".css"):
        return "css"
    return "other"


def load_once(browser: Browser, base_url: str) -> dict[str, Any]:
    """One cold load: a fresh context (empty cache) with the operator's session cookie."""
    context = browser.new_context(viewport={"width": 1440, "height": 1000})
    # Signed in through the form, as an operator would (sessions live in the database).
    signed_in = httpx.post(f"{base_url}/admin/login", data={"token": TOKEN}, timeout=30)
    session = signed_in.cookies[ADMIN_COOKIE]
    context.add_cookies([{"name": ADMIN_COOKIE, "value": session, "url": base_url}])
    page = context.new_page()
    try:
        started = time.perf_counter()
        page.goto(f"{base_url}/admin?window={WINDOW_S}")
        page.wait_for_selector("html[data-ready=true]", timeout=30_000)
        wall_ms = (time.perf_counter() - started) * 1000
        timing = page.evaluate(RESOURCES)
        canvases = page.locator("#cloud-chart canvas").count()
        points = int(page.get_attribute("#cloud-chart", "data-points") or 0)
    finally:
        context.close()
    sizes = {"html": timing["html"]["transfer"], "js": 0, "css": 0, "api_json": 0, "other": 0}
    decoded = {"html": timing["html"]["decoded"], "js": 0, "css": 0, "api_json": 0, "other": 0}
    for resource in timing["resources"]:
        sizes[_kind(resource["name"])] += resource["transfer"]
        decoded[_kind(resource["name"])] += resource["decoded"]
    return {
        "ready_ms": round(timing["ready_ms"], 1),
        "dom_content_loaded_ms": round(timing["dom_content_loaded_ms"], 1),
        "wall_ms": round(wall_ms, 1),
        "bytes": sizes,
        "decoded_bytes": decoded,
        "total_bytes": sum(sizes.values()),
        "charts_drawn": canvases == 1,
        "history_points": points,
        "resources": [
            {k: r[k] for k in ("name", "transfer", "decoded", "duration")}
            for r in timing["resources"]
        ],
    }


def api_timings(base_url: str, repeats: int) -> dict[str, dict[str, float]]:
    """Server time of the history endpoints over the day (gzip, as the browser asks)."""
    headers = {"Authorization": f"Bearer {TOKEN}", "Accept-Encoding": "gzip"}
    out = {}
    with httpx.Client(base_url=base_url, headers=headers, timeout=30) as client:
        for path in (
            "/admin/api/history",
            "/admin/api/drift?series=false",
            "/admin/api/drift",
            "/admin/api/sites/aws-us-east-1",
        ):
            times, size = [], 0
            for _ in range(repeats):
                started = time.perf_counter()
                response = client.get(f"{path}{'&' if '?' in path else '?'}window_s={WINDOW_S}")
                times.append((time.perf_counter() - started) * 1000)
                response.raise_for_status()
                size = int(response.headers.get("content-length", 0))
            out[path] = {"median_ms": round(statistics.median(times), 1), "gzip_bytes": size}
    return out


def _federation(path: Path, tokenizer_dir: Path) -> Path:
    sites = [
        {
            "name": name,
            "cloud": cloud,
            "region": region,
            "model": "tiny",
            "endpoint": f"127.0.0.1:{free_port()}",
        }
        for name, cloud, region in SITES
    ]
    models = [{"name": "tiny", "tokenizer": str(tokenizer_dir.resolve())}]
    path.write_text(json.dumps({"models": models, "sites": sites}))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=7, help="cold page loads to time")
    parser.add_argument("--interval-s", type=int, default=10, help="the sampler's resolution")
    parser.add_argument("--requests", type=int, default=50_000, help="requests over the day")
    parser.add_argument("--tokenizer-dir", type=Path, default=Path("../shared/tokenizers/gpt2"))
    parser.add_argument("--database-url", help="an EMPTY database (default: SQLite in a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        url = args.database_url or f"sqlite+aiosqlite:///{work / 'gateway.db'}"
        started = time.perf_counter()
        counts = seed(url, interval_s=args.interval_s, requests=args.requests)
        seed_s = time.perf_counter() - started
        print(f"seeded {counts} in {seed_s:.1f}s", file=sys.stderr)
        gateway = start_gateway(
            federation_file=_federation(work / "federation.json", args.tokenizer_dir),
            database_url=url,
            log_dir=work,
            expect_healthy_sites=0,  # the sites are history only: nothing serves
            env={"GATEWAY_ADMIN_TOKEN": TOKEN, "GATEWAY_HEALTH_INTERVAL_S": "5"},
        )
        try:
            base_url = f"http://127.0.0.1:{gateway.port}"
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
                try:
                    load_once(browser, base_url)  # warms the server (imports, DB pages)
                    loads = [load_once(browser, base_url) for _ in range(args.runs)]
                finally:
                    browser.close()
            apis = api_timings(base_url, repeats=10)
        finally:
            gateway.stop()
    report(args, counts, loads, apis)


def report(
    args: argparse.Namespace,
    counts: dict[str, int],
    loads: list[dict[str, Any]],
    apis: dict[str, dict[str, float]],
) -> None:
    ready = [x["ready_ms"] for x in loads]
    median_load = sorted(loads, key=lambda x: x["ready_ms"])[len(loads) // 2]
    load_average = [round(x, 2) for x in os.getloadavg()]
    payload = {
        "window_s": WINDOW_S,
        "load_average_1_5_15_min": load_average,
        "seeded": counts,
        "sample_interval_s": args.interval_s,
        "runs": args.runs,
        "ready_ms": {"median": statistics.median(ready), "max": max(ready), "min": min(ready)},
        "bytes_median_run": median_load["bytes"],
        "decoded_bytes_median_run": median_load["decoded_bytes"],
        "total_bytes_median_run": median_load["total_bytes"],
        "charts_drawn": all(x["charts_drawn"] for x in loads),
        "history_points": median_load["history_points"],
        "api": apis,
        "loads": loads,
    }
    kinds = ["html", "js", "css", "api_json"]
    md = [
        f"A day ({WINDOW_S} s) of history for {counts['sites']} sites: "
        f"{counts['load_samples']:,} load samples ({args.interval_s} s resolution) and "
        f"{counts['requests']:,} requests, SQLite. Cold loads of `/admin?window={WINDOW_S}` "
        "in headless Chromium (fresh context each, nothing cached), from navigation to the "
        "headline chart and tables drawn (`performance.mark('dashboard-ready')`). "
        f"Machine load average at the end (1/5/15 min): {load_average} on {os.cpu_count()} "
        "CPUs (shared with other work: timings are upper bounds).",
        "",
        markdown_table(
            ["runs", "median ms", "min ms", "max ms", "history points per series"],
            [
                [
                    args.runs,
                    payload["ready_ms"]["median"],
                    min(ready),
                    max(ready),
                    payload["history_points"],
                ]
            ],
        ),
        "",
        "Bytes on the wire (median run; transfer size incl. headers, gzip where accepted):",
        "",
        markdown_table(
            ["kind", "transferred", "decoded"],
            [[k, median_load["bytes"][k], median_load["decoded_bytes"][k]] for k in kinds]
            + [["total", median_load["total_bytes"], sum(median_load["decoded_bytes"].values())]],
        ),
        "",
        "Server time of the history endpoints over the day (median of 10):",
        "",
        markdown_table(
            ["endpoint", "median ms", "gzip bytes"],
            [[path, v["median_ms"], v["gzip_bytes"]] for path, v in apis.items()],
        ),
    ]
    path = write_results(
        "dashboard", payload, "\n".join(md), "python -m bench.dashboard", results_dir("dashboard")
    )
    print("\n".join(md))
    print(f"wrote {path}", file=sys.stderr)
