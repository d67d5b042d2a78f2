"""Token-aware routing through the public API: the gateway's ledger of outstanding tokens steers
new requests away from a site that is busy with a long answer."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_least_tokens_sends_short_requests_away_from_a_long_one(start_federation) -> None:
    federation = start_federation(
        live=["aws-use1", "gcp-euw4"], env={"GATEWAY_ROUTING_POLICY": "least_tokens"}
    )
    url = f"{federation.base_url}/v1/completions"
    long_site: list[str] = []

    def long_request() -> None:
        body = {
            "model": "tiny",
            "prompt": "a long one",
            "max_tokens": 700,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", url, json=body, timeout=120) as response:
            long_site.append(response.headers["x-fedllm-site"])
            for _ in response.iter_lines():
                pass

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 30
    while not long_site:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    short_sites = [
        httpx.post(
            url, json={"model": "tiny", "prompt": f"short {i}", "max_tokens": 4}, timeout=60
        ).headers["x-fedllm-site"]
        for i in range(4)
    ]
    worker.join(timeout=120)
    assert long_site[0] not in short_sites, (long_site, short_sites)
    rows = federation.rows()
    assert {row["routing_policy"] for row in rows} == {"least_tokens"}
    for row in rows:  # every decision is explained: both sites scored, the winner lowest
        detail = json.loads(str(row["routing_detail"]))
        assert set(detail["scores"]) == {"aws-use1", "gcp-euw4"}
        assert detail["scores"][row["site_name"]] == min(detail["scores"].values())
        assert detail["planned_answer_tokens"] in (4, 700)
