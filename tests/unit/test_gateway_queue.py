"""The gateway's queue (gateway/request_path/hold.py): a request every site pushes back waits
there instead of its 503, is placed in the queue's order as a site makes room, gets its 503
past the timeout, and leaves the queue when its client goes; with no queue (the default) the
503 comes at once. Real sites' states, routing and dispatches; nothing is sent to a site."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.api.openai_errors import OpenAIError, to_openai
from gateway.db.session import create_engine, create_sessionmaker
from gateway.dispatch.request import PreparedCompletion
from gateway.dispatch.stream import Dispatch
from gateway.errors import GatewayError
from gateway.federation import ModelConfig, SiteConfig
from gateway.queue_settings import QueueSettings
from gateway.request_path.hold import Placed
from gateway.request_path.prepare import Delivery, Sampling
from gateway.request_path.service import CompletionService
from gateway.routing.policy import build_policy
from gateway.settings import GatewaySettings
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.interface import SiteInfoView
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.stores.request_log import RequestLog
from gateway.tokenizers import ModelTokenizers


async def _service(tokenizer: Path, queue: QueueSettings) -> tuple[CompletionService, SiteState]:
    """One site of one batch slot, whose queue is full at one request (the routing bound)."""
    site = SiteState(
        SiteConfig("a", "aws", "r", "127.0.0.1:1", "m"), 1, GrpcSiteClient("a", "127.0.0.1:1", 1.0)
    )
    site.mark_healthy(
        SiteInfoView("a", "m", 1024, 50257, "f", "cpu", "float32", 16, 64, 1, "e", "v")
    )
    service = CompletionService(
        GatewaySettings(federation_file=Path("unused.json"), queue=queue),
        SiteRegistry([site]),
        ModelTokenizers((ModelConfig("m", tokenizer),)),
        build_policy("least_requests", max_site_queue=1),
        RequestLog(create_sessionmaker(create_engine("sqlite+aiosqlite://"))),
    )
    return service, site


def _prepared(service: CompletionService, predicted: int | None) -> PreparedCompletion:
    prepared = service.preparer.prepare_tokens(
        "m", [1, 2, 3], "hi", Sampling(max_tokens=600), Delivery()
    )
    return replace(prepared, params=replace(prepared.params, predicted_tokens=predicted))


def _fill(service: CompletionService, site: SiteState) -> list[Dispatch]:
    """One running, one queued: every further request is pushed back (while the caller keeps
    the dispatches: a dropped one gives its place back)."""
    placed = [service.open_dispatch(_prepared(service, 1), site) for _ in range(2)]
    assert site.queued_requests == 1
    return placed


def _never(site: SiteState) -> Dispatch:
    raise AssertionError(f"no site has room, yet {site.name} was given a held request")


def test_held_requests_are_placed_shortest_predicted_first_as_the_site_makes_room(
    gpt2_tokenizer_dir: Path,
) -> None:
    async def run() -> None:
        queue = QueueSettings(max_requests=8, order="spf", poll_ms=2, timeout_s=30.0)
        service, site = await _service(gpt2_tokenizer_dir, queue)
        running, queued = _fill(service, site)
        opened: list[str] = []

        def hold(name: str, predicted: int) -> asyncio.Task[Placed | None]:
            prepared = _prepared(service, predicted)

            def open_on(chosen: SiteState) -> Dispatch:
                opened.append(name)
                return service.open_dispatch(prepared, chosen)

            assert service.queue.takes(service.router.decide(prepared))
            return asyncio.create_task(service.queue.wait(prepared, open_on))

        tasks = [hold("long", 500), hold("mid", 80), hold("short", 5)]
        await asyncio.sleep(0.05)
        assert opened == []  # every site still pushes back
        assert len(service.queue) == 3
        running.abandon()  # one ends: room for one
        await asyncio.sleep(0.05)
        assert opened == ["short"]
        queued.abandon()
        await asyncio.sleep(0.05)
        assert opened == ["short", "mid"]
        placed = await tasks[2]
        assert placed is not None
        assert placed[1].site is site
        assert not tasks[0].done()  # the long one still waits
        tasks[0].cancel()  # its client goes away: it leaves the queue
        await asyncio.gather(tasks[0], return_exceptions=True)
        assert len(service.queue) == 0
        await service.queue.close()
        await site.client.close()

    asyncio.run(run())


@pytest.mark.parametrize("order", ["fcfs", "spf"])
def test_fcfs_holds_the_arrival_order(gpt2_tokenizer_dir: Path, order: str) -> None:
    async def run() -> list[str]:
        queue = QueueSettings(max_requests=8, order=order, poll_ms=2)  # type: ignore[arg-type]
        service, site = await _service(gpt2_tokenizer_dir, queue)
        running, queued = _fill(service, site)
        opened: list[str] = []
        tasks = []
        for name, predicted in [("long", 500), ("short", 5)]:
            prepared = _prepared(service, predicted)

            def open_on(
                chosen: SiteState, p: PreparedCompletion = prepared, n: str = name
            ) -> Dispatch:
                opened.append(n)
                return service.open_dispatch(p, chosen)

            tasks.append(asyncio.create_task(service.queue.wait(prepared, open_on)))
        await asyncio.sleep(0.02)
        running.abandon()
        await asyncio.sleep(0.05)
        await service.queue.close()
        await asyncio.gather(*tasks)
        queued.abandon()
        await site.client.close()
        return opened

    assert asyncio.run(run()) == (["long"] if order == "fcfs" else ["short"])


def test_a_request_held_past_the_timeout_gets_its_503(gpt2_tokenizer_dir: Path) -> None:
    async def run() -> None:
        queue = QueueSettings(max_requests=8, poll_ms=2, timeout_s=0.05)
        service, site = await _service(gpt2_tokenizer_dir, queue)
        placed = _fill(service, site)
        started = asyncio.get_running_loop().time()
        with pytest.raises((OpenAIError, GatewayError)) as refused:
            await service.dispatch(_prepared(service, None))
        waited = asyncio.get_running_loop().time() - started
        assert 0.05 <= waited < 5.0
        error = to_openai(refused.value)
        assert (error.status, error.retry_after_s) == (503, 1)
        assert "queue_bound: 0" in error.body.message
        assert service.queue.timed_out == 1
        assert len(service.queue) == 0
        assert service.admitter.bound.in_flight == 0
        for dispatch in placed:
            dispatch.abandon()
        await service.queue.close()
        await service.records.writer.drain(timeout_s=0.1)  # its table-less log takes nothing
        await site.client.close()

    asyncio.run(run())


def test_without_a_queue_the_503_comes_at_once_and_a_full_queue_holds_no_more(
    gpt2_tokenizer_dir: Path,
) -> None:
    async def run() -> None:
        for held in (0, 1):
            queue = QueueSettings(max_requests=held, poll_ms=2, timeout_s=30.0)
            service, site = await _service(gpt2_tokenizer_dir, queue)
            placed = _fill(service, site)
            waiting = []
            if held:  # the one place is taken
                prepared = _prepared(service, 3)
                waiting.append(
                    asyncio.create_task(service.queue.wait(prepared, placed[0].__class__))
                )
                await asyncio.sleep(0)
            started = asyncio.get_running_loop().time()
            with pytest.raises((OpenAIError, GatewayError)) as refused:
                await service.dispatch(_prepared(service, None))
            assert asyncio.get_running_loop().time() - started < 1.0
            assert to_openai(refused.value).status == 503
            assert service.queue.held_total == held
            await service.queue.close()  # the one held is answered None (its 503) at shutdown
            await service.records.writer.drain(timeout_s=0.1)
            assert [await task for task in waiting] == [None] * held
            for dispatch in placed:
                dispatch.abandon()
            await site.client.close()

    asyncio.run(run())
