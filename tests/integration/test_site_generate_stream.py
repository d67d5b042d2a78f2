"""GenerateStream (issue 74): a gateway's requests to a real site process on one gRPC call, through
the gateway's own client. Each request gets what its own Generate call gives (the same tokens,
text and usage), whatever else shares the call; refusals, cancels and deadlines act per request."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path

import grpc
import pytest

from devtools.launch import ManagedProcess, start_site
from fedllm_contract.proto import site_pb2, site_pb2_grpc
from fedllm_contract.proto.options import options_to_proto
from fedllm_contract.request_options import RequestOptions
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.grpc_generate_stream import ChunkPacer
from gateway.sites.interface import (
    GenerateParams,
    SiteBusy,
    SiteChunk,
    SiteRejected,
    SiteTimedOut,
    SiteUnavailable,
)

pytestmark = pytest.mark.slow
PROMPTS = [(11, 22, 33, 44), (5, 6, 7), (100, 200, 300, 400, 500), (9, 8, 7, 6, 5, 4)]


@pytest.fixture(scope="module")
def site(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ManagedProcess]:
    # Two sequences at a time and four waiting: a burst queues, and past that is refused.
    process = start_site(
        extra_args=["--max-num-seqs", "2", "--max-queued-requests", "4"],
        model_dir=tiny_llama_dir,
        site_name="stream-test",
        model_name="tiny",
        log_dir=tmp_path_factory.mktemp("logs"),
    )
    yield process
    process.stop()


def params(prompt: tuple[int, ...], max_tokens: int = 12, **options: object) -> GenerateParams:
    return GenerateParams(
        request_id=f"gs-{uuid.uuid4().hex[:12]}",
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        options=RequestOptions(**options),  # type: ignore[arg-type]
    )


def one_call(site: ManagedProcess, p: GenerateParams) -> list[site_pb2.GenerateChunk]:
    """The same request on a Generate call of its own (the reference)."""
    request = site_pb2.GenerateRequest(
        request_id=f"ref-{p.request_id}",
        prompt_token_ids=p.prompt_token_ids,
        sampling=site_pb2.SamplingParams(max_tokens=p.max_tokens),
    )
    options_to_proto(p.options, request)
    with grpc.insecure_channel(f"127.0.0.1:{site.port}") as channel:
        return list(site_pb2_grpc.SiteEngineStub(channel).Generate(request, timeout=60))


async def collect(client: GrpcSiteClient, p: GenerateParams) -> list[SiteChunk]:
    return [chunk async for chunk in client.generate(p, timeout_s=60)]


def client_of(site: ManagedProcess) -> GrpcSiteClient:
    return GrpcSiteClient("stream-test", f"127.0.0.1:{site.port}", connect_timeout_s=5)


def test_concurrent_requests_on_one_call_match_their_own_calls(site: ManagedProcess) -> None:
    requests = [params(PROMPTS[i], max_tokens=6 + i, seed=i) for i in range(4)]

    async def run() -> list[list[SiteChunk]]:
        client = client_of(site)
        try:
            return await asyncio.gather(*(collect(client, p) for p in requests))
        finally:
            await client.close()

    answers = asyncio.run(run())
    for p, chunks in zip(requests, answers, strict=True):
        reference = one_call(site, p)
        assert chunks[0].accepted
        ids = [t for c in chunks for t in c.token_ids]
        assert ids == [t for c in reference for t in c.token_ids]
        assert "".join(c.text for c in chunks) == "".join(c.text for c in reference)
        final = chunks[-1]
        assert final.finish_reason == "length"
        assert (
            (final.prompt_tokens, final.completion_tokens)
            == (
                reference[-1].usage.prompt_tokens,
                reference[-1].usage.completion_tokens,
            )
            == (len(p.prompt_token_ids), p.max_tokens)
        )
        assert all(c.finish_reason is None for c in chunks[:-1])


def test_choices_and_stop_strings_over_the_call(site: ManagedProcess) -> None:
    many = params(PROMPTS[0], max_tokens=5, n=3, seed=7, temperature=1.0)

    async def run() -> list[SiteChunk]:
        client = client_of(site)
        try:
            return await collect(client, many)
        finally:
            await client.close()

    chunks = asyncio.run(run())
    finishing = [c for c in chunks if c.finish_reason is not None]
    assert sorted(c.index for c in finishing) == [0, 1, 2]
    # The last finishing chunk carries the request's usage: every choice's tokens.
    assert finishing[-1].completion_tokens == 15
    for index in range(3):
        assert sum(len(c.token_ids) for c in chunks if c.index == index) == 5


def test_a_refused_request_fails_alone(site: ManagedProcess) -> None:
    bad = params(PROMPTS[0], logit_bias=((10**9, 1.0),))
    good = params(PROMPTS[1], max_tokens=4)

    async def run() -> tuple[BaseException | list[SiteChunk], ...]:
        client = client_of(site)
        try:
            both = collect(client, bad), collect(client, good)
            return tuple(await asyncio.gather(*both, return_exceptions=True))
        finally:
            await client.close()

    refused, served = asyncio.run(run())
    assert isinstance(refused, SiteRejected)
    assert "vocabulary" in refused.detail
    assert isinstance(served, list)
    assert served[-1].completion_tokens == 4


def test_past_the_queue_bound_a_request_is_busy_and_the_rest_are_served(
    site: ManagedProcess,
) -> None:
    # 2 running + 4 waiting: of 10 at once, some find the queue full (SiteBusy, try elsewhere).
    burst = [params(PROMPTS[i % 4], max_tokens=40) for i in range(10)]

    async def run() -> list[BaseException | list[SiteChunk]]:
        client = client_of(site)
        try:
            return list(
                await asyncio.gather(*(collect(client, p) for p in burst), return_exceptions=True)
            )
        finally:
            await client.close()

    outcomes = asyncio.run(run())
    busy = [o for o in outcomes if isinstance(o, SiteBusy)]
    served = [o for o in outcomes if isinstance(o, list)]
    assert busy
    assert served
    assert len(busy) + len(served) == 10
    assert all(o[-1].completion_tokens == 40 for o in served)


async def running(site: ManagedProcess) -> int:
    client = client_of(site)
    try:
        async with aclosing(client.load_reports(20)) as reports:
            async for report in reports:
                return report.running_requests + report.queued_requests
    finally:
        await client.close()
    raise AssertionError("no load report")


def test_closing_a_request_early_cancels_it_at_the_site(site: ManagedProcess) -> None:
    async def run() -> tuple[int, int]:
        client = client_of(site)
        try:
            p = params(PROMPTS[2], max_tokens=500)
            got = 0
            async with aclosing(client.generate(p, timeout_s=60)) as chunks:
                async for chunk in chunks:
                    got += len(chunk.token_ids)
                    if got >= 3:
                        break
            for _ in range(100):  # the cancel reaches the site on the call, then its engine
                if await running(site) == 0:
                    break
                await asyncio.sleep(0.05)
            return got, await running(site)
        finally:
            await client.close()

    got, left = asyncio.run(run())
    assert got >= 3
    assert left == 0


def test_a_request_past_its_deadline_ends_and_leaves_the_site(site: ManagedProcess) -> None:
    async def run() -> BaseException | None:
        client = client_of(site)
        try:
            p = params(PROMPTS[3], max_tokens=1000)
            try:
                async for _ in client.generate(p, timeout_s=0.5):
                    pass
            except (SiteTimedOut, SiteUnavailable) as exc:
                for _ in range(100):
                    if await running(site) == 0:
                        break
                    await asyncio.sleep(0.05)
                return exc
            return None
        finally:
            await client.close()

    failure = asyncio.run(run())
    assert isinstance(failure, SiteTimedOut)  # it was accepted, then ran out of time
    assert asyncio.run(running(site)) == 0


def test_a_site_that_goes_away_fails_the_requests_on_the_call(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    process = start_site(
        model_dir=tiny_llama_dir,
        site_name="stream-gone",
        model_name="tiny",
        log_dir=tmp_path_factory.mktemp("logs"),
    )

    async def run() -> BaseException | None:
        client = GrpcSiteClient("stream-gone", f"127.0.0.1:{process.port}", connect_timeout_s=5)
        try:
            got = 0
            async for chunk in client.generate(params(PROMPTS[0], max_tokens=1000), 60):
                got += len(chunk.token_ids)
                if got >= 2:
                    process.kill()
        except Exception as exc:  # the failure is what is checked
            return exc
        finally:
            await client.close()
        return None

    try:
        failure = asyncio.run(run())
    finally:
        process.stop()
    # Accepted, then the site broke under it: the dispatcher continues it elsewhere.
    assert type(failure).__name__ == "SiteFailed"


def test_a_chunk_budget_sends_tokens_together_and_the_first_at_once(
    site: ManagedProcess,
) -> None:
    p = params(PROMPTS[1], max_tokens=200, seed=3)

    async def run() -> tuple[list[SiteChunk], list[float], float]:
        # One answer streaming under a budget of 4 chunks a second: one every 0.25 s.
        client = GrpcSiteClient(
            "stream-test", f"127.0.0.1:{site.port}", connect_timeout_s=5, pacer=ChunkPacer(4.0)
        )
        loop = asyncio.get_running_loop()
        started = loop.time()
        chunks, times = [], []
        try:
            async for chunk in client.generate(p, timeout_s=60):
                chunks.append(chunk)
                times.append(loop.time())
        finally:
            await client.close()
        return chunks, times, started

    chunks, times, started = asyncio.run(run())
    reference = one_call(site, p)
    assert [t for c in chunks for t in c.token_ids] == [t for c in reference for t in c.token_ids]
    assert "".join(c.text for c in chunks) == "".join(c.text for c in reference)
    with_tokens = [(c, t) for c, t in zip(chunks, times, strict=True) if c.token_ids]
    # The first token is not held back (it follows the acceptance at once); after it, chunks
    # come at most every 0.25 s (the last, with its finish, as soon as it comes).
    assert with_tokens[0][1] - times[0] < 0.2
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(with_tokens)]
    assert all(gap >= 0.2 for gap in gaps[:-1])
    assert len(with_tokens) <= (times[-1] - started) / 0.25 + 3
    assert chunks[-1].finish_reason == "length"
