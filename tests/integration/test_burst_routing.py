"""A burst of requests routed while the earlier ones are still being recorded: each decision must
already see the requests placed before it, or load-aware policies herd the burst onto one site."""

from __future__ import annotations

import asyncio
import gc
import json
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.api.body import decode_body
from gateway.api.completion_schemas import CompletionRequest
from gateway.db.migrate import upgrade
from gateway.db.session import create_engine, create_sessionmaker
from gateway.dispatch.request import PreparedCompletion
from gateway.errors import GatewayError
from gateway.federation import ModelConfig, SiteConfig
from gateway.request_path.service import CompletionService
from gateway.routing.policy import build_policy
from gateway.settings import GatewaySettings
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import SiteInfoView
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.stores.request_log import RequestLog
from gateway.stores.site_store import sync_sites
from gateway.tokenizers import ModelTokenizers

SITES = tuple(SiteConfig(name, "aws", "r", f"127.0.0.1:{port}", "m") for name, port in
              (("a", 1), ("b", 2), ("c", 3)))  # fmt: skip


def _info(name: str) -> SiteInfoView:
    return SiteInfoView(name, "m", 1024, 4096, "f", "cpu", "float32", 16, 256, 8, "e", "v")


async def _service(
    url: str, policy: str, tokenizer_dir: Path
) -> tuple[CompletionService, AsyncEngine]:
    engine = create_engine(url)
    ids = await sync_sites(create_sessionmaker(engine), SITES)
    states = [
        SiteState(
            cfg,
            ids[cfg.name],
            GrpcSiteClient(cfg.name, cfg.endpoint, 1.0),
            healthy=True,
            info=_info(cfg.name),
        )
        for cfg in SITES
    ]
    service = CompletionService(
        GatewaySettings(federation_file=Path("unused.json")),
        SiteRegistry(states),
        ModelTokenizers((ModelConfig("m", tokenizer_dir),)),
        build_policy(policy),
        RequestLog(create_sessionmaker(engine)),
    )
    return service, engine


def _request(service: CompletionService, max_tokens: int = 64) -> PreparedCompletion:
    body = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": max_tokens})
    return service.prepare(decode_body(body.encode(), CompletionRequest))


async def _close(sites: list[SiteState], engine: AsyncEngine) -> None:
    for site in sites:
        await site.client.close()
    await engine.dispose()


@pytest.mark.parametrize("policy", ["least_requests", "least_tokens", "mico"])
def test_a_burst_is_spread_and_unused_dispatches_give_their_place_back(
    sqlite_url: str, gpt2_tokenizer_dir: Path, policy: str
) -> None:
    async def burst() -> None:
        upgrade(sqlite_url)
        service, engine = await _service(sqlite_url, policy, gpt2_tokenizer_dir)
        sites = service.router.registry.all()
        try:
            dispatches = await asyncio.gather(
                *(service.dispatch(_request(service)) for _ in range(9))
            )
            per_site = Counter(d.site.name for d in dispatches)
            assert sorted(per_site.values()) == [3, 3, 3], per_site
            assert [s.in_flight for s in sites] == [3, 3, 3]
            assert len({s.ledger_tokens for s in sites}) == 1
            assert sites[0].ledger_tokens > 0
            # Streams the server never started (the clients went away): their places come back.
            del dispatches
            await asyncio.sleep(0)  # the gathered tasks, which hold them too, are let go
            gc.collect()
            assert [(s.in_flight, s.ledger_tokens) for s in sites] == [(0, 0)] * 3
            assert service.admitter.bound.in_flight == 0
        finally:
            await _close(sites, engine)

    asyncio.run(burst())


def test_a_request_refused_while_the_request_log_is_behind_takes_no_place(
    sqlite_url: str, gpt2_tokenizer_dir: Path
) -> None:
    """The request log is written behind the requests; while its queue is full (the database
    refuses writes) a new request is refused before it is routed, so no site counts it."""

    async def refused() -> None:
        upgrade(sqlite_url)
        service, engine = await _service(sqlite_url, "least_tokens", gpt2_tokenizer_dir)
        sites = service.router.registry.all()
        try:
            first = await service.dispatch(_request(service))
            writer = service.records.writer
            writer.capacity = len(writer)  # full: nothing written yet
            with pytest.raises(GatewayError) as behind:
                await service.dispatch(_request(service))
            assert behind.value.retry_after_s is not None
            held = [(s.in_flight, s.ledger_tokens) for s in sites]
            assert sorted(count for count, _ in held) == [0, 0, 1]
            assert sum(tokens for _, tokens in held) == first._lease.tokens
            await writer.flush()  # written: there is room again
            assert not writer.full
            second = await service.dispatch(_request(service))
            assert sum(s.in_flight for s in sites) == 2
            del first, second
        finally:
            await service.drain()
            await _close(sites, engine)

    asyncio.run(refused())
