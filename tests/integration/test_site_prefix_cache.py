"""A real site process with prefix caching, over real gRPC, read through the gateway's adapter.

What the site says about its cache must be what the gateway can compute on its own: stored ids
are fedllm_contract.block_hash ids of the prompt under the served model's name and the
request's salt, in chain order with their parent; a new subscriber's first report is a snapshot
of every block held; a request that repeats a prompt reports its cached tokens in its usage; the
load report's counters and the HTTP face's vLLM-named counters add up; `--no-prefix-caching`
turns all of it off.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from pathlib import Path

import httpx
import pytest

from devtools.launch import ManagedProcess, free_port, start_site
from fedllm_contract.block_hash import HASH_SCHEME, prompt_block_hashes
from fedllm_contract.cache_events import (
    CHAIN_START,
    BlocksRemoved,
    BlocksStored,
    CacheEventBatch,
    Tier,
)
from fedllm_contract.request_options import RequestOptions
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import GenerateParams, LoadView, SiteChunk

pytestmark = pytest.mark.slow
BLOCK = 4
PROMPT = tuple(range(1000, 1000 + 5 * BLOCK + 2))  # five full blocks and two tokens


def _start(tiny_llama_dir: Path, logs: Path, *extra: str) -> ManagedProcess:
    return start_site(
        extra_args=["--block-size", str(BLOCK), *extra],
        model_dir=tiny_llama_dir,
        site_name="cache-test",
        model_name="tiny",
        log_dir=logs,
    )


@pytest.fixture(scope="module")
def http_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def site(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, http_port: int
) -> Iterator[ManagedProcess]:
    process = _start(tiny_llama_dir, tmp_path_factory.mktemp("logs"), "--http-port", str(http_port))
    yield process
    process.stop()


def _client(site: ManagedProcess) -> GrpcSiteClient:
    return GrpcSiteClient("cache-test", f"127.0.0.1:{site.port}", 30.0)  # a loaded CI machine


async def _generate(client: GrpcSiteClient, request_id: str, salt: str = "") -> SiteChunk:
    params = GenerateParams(
        request_id, PROMPT, max_tokens=3, options=RequestOptions(temperature=0), cache_salt=salt
    )
    chunks = [chunk async for chunk in client.generate(params, timeout_s=60)]
    return chunks[-1]


async def _batches_until(
    reports: AsyncGenerator[LoadView, None], stored: set[int]
) -> list[CacheEventBatch]:
    """Reads reports until the device ids stored (and not removed since) include `stored`."""
    held: set[int] = set()
    batches: list[CacheEventBatch] = []
    while not stored <= held:
        report = await asyncio.wait_for(anext(reports), 30)
        assert report.cache_events is not None
        batches.append(report.cache_events)
        for event in report.cache_events.events:
            if isinstance(event, BlocksStored) and event.tier is Tier.DEVICE:
                held.update(event.block_ids)
            elif isinstance(event, BlocksRemoved) and event.tier is Tier.DEVICE:
                held.difference_update(event.block_ids)
    return batches


def test_cache_events_usage_and_counters(site: ManagedProcess, http_port: int) -> None:
    expected = prompt_block_hashes(PROMPT, BLOCK, "tiny")
    salted = prompt_block_hashes(PROMPT, BLOCK, "tiny", "tenant-b")

    async def run() -> None:
        client = _client(site)
        try:
            info = await client.info()
            assert (info.prefix_caching, info.block_hash_scheme) == (True, HASH_SCHEME)
            async with aclosing(client.load_reports(20, cache_events=True)) as reports:
                first = await anext(reports)
                assert first.cache_events is not None
                assert first.cache_events.snapshot
                assert (first.cache_events.sequence, first.cache_events.block_size) == (1, BLOCK)
                assert (await _generate(client, "p-1")).cached_prompt_tokens == 0
                batches = await _batches_until(reports, set(expected))
                assert [b.sequence for b in batches] == list(range(2, 2 + len(batches)))
                assert {b.epoch for b in batches} == {first.cache_events.epoch}
                stored = [e for b in batches for e in b.events if isinstance(e, BlocksStored)]
                chain = [h for e in stored for h in e.block_ids]
                assert chain[: len(expected)] == expected
                assert stored[0].parent == CHAIN_START
                # The prompt is cached: all five full blocks (its last token is computed).
                assert (await _generate(client, "p-2")).cached_prompt_tokens == 5 * BLOCK
                # Another salt shares nothing, and its ids are its own.
                assert (await _generate(client, "p-3", "tenant-b")).cached_prompt_tokens == 0
                await _batches_until(reports, set(salted))
                load = await anext(reports)
                assert load.prefix_cache_hits == 5 * BLOCK
                assert load.prefix_cache_queries == 3 * len(PROMPT)
            # A new subscriber starts from a snapshot of what is held.
            async with aclosing(client.load_reports(20, cache_events=True)) as again:
                snap = await anext(again)
                assert snap.cache_events is not None
                assert snap.cache_events.snapshot
                events = snap.cache_events.events
                assert all(isinstance(e, BlocksStored) for e in events)
                held = {h for e in events if isinstance(e, BlocksStored) for h in e.block_ids}
                assert set(expected) | set(salted) <= held
        finally:
            await client.close()

    asyncio.run(run())
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10)
    text = metrics.read().decode()
    assert 'vllm:prefix_cache_hits_total{model_name="tiny"} 20.0' in text
    assert 'vllm:prefix_cache_queries_total{model_name="tiny"} 66.0' in text


def test_without_prefix_caching_nothing_is_cached_or_reported(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    site = _start(tiny_llama_dir, tmp_path, "--no-prefix-caching")

    async def run() -> None:
        client = _client(site)
        try:
            info = await client.info()
            assert (info.prefix_caching, info.block_hash_scheme) == (False, "")
            for name in ("n-1", "n-2"):
                assert (await _generate(client, name)).cached_prompt_tokens == 0
            async with aclosing(client.load_reports(20, cache_events=True)) as reports:
                report = await anext(reports)
            assert report.cache_events is not None
            assert report.cache_events.events == ()
            assert (report.prefix_cache_queries, report.prefix_cache_hits) == (0, 0)
        finally:
            await client.close()

    try:
        asyncio.run(run())
    finally:
        site.stop()


def test_the_http_face_reports_cached_tokens(site: ManagedProcess, http_port: int) -> None:
    body = {"model": "tiny", "prompt": list(range(3000, 3022)), "max_tokens": 2, "temperature": 0}
    cached = []
    for _ in range(2):
        response = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        cached.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, 5 * BLOCK]
