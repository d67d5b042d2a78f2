"""OpenAISiteClient against a real HTTP server speaking the OpenAI API (a fake engine on a
loopback port): streaming, the engine's failures as the interface's, cancel, and load reports
from the ledger and the engine's vLLM- or SGLang-named metrics."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from pathlib import Path

import pytest

from devtools.launch import free_port
from fedllm_contract.request_options import RequestOptions
from gateway.federation import ModelConfig, OpenAISiteConfig
from gateway.sites.interface import (
    AdapterChangeRefused,
    GenerateParams,
    LoadView,
    SiteBusy,
    SiteChunk,
    SiteFailed,
    SiteRejected,
    SiteUnavailable,
)
from gateway.sites.openai_client import OpenAISiteClient
from gateway.tokenizers import ModelTokenizers
from tests.support.fake_openai_engine import EngineState, RunningEngine, running_engine


@pytest.fixture(scope="module")
def tokenizers(gpt2_tokenizer_dir: Path) -> ModelTokenizers:
    return ModelTokenizers((ModelConfig("m", gpt2_tokenizer_dir),))


def client_for(engine: RunningEngine, tokenizers: ModelTokenizers, **config: object):
    settings = OpenAISiteConfig(
        base_url=engine.base_url,
        engine_model=str(config.pop("engine_model", engine.state.model)),
        metrics_url=engine.metrics_url,
        metrics_dialect=engine.state.dialect,  # type: ignore[arg-type]
        metrics_interval_ms=100,
        **config,  # type: ignore[arg-type]
    )
    return OpenAISiteClient("ext", "m", settings, tokenizers, connect_timeout_s=2.0)


def params(max_tokens: int = 5, request_id: str = "r1") -> GenerateParams:
    return GenerateParams(
        request_id, (10, 11, 12), max_tokens, RequestOptions(temperature=0.0), predicted_tokens=4
    )


async def collect(client: OpenAISiteClient, p: GenerateParams) -> list[SiteChunk]:
    chunks = []
    async with aclosing(client.generate(p, 10.0)) as stream:
        async for chunk in stream:
            chunks.append(chunk)
    return chunks


def test_a_streamed_answer_arrives_whole_with_the_engines_usage(tokenizers) -> None:
    with running_engine() as engine:
        client = client_for(engine, tokenizers)

        async def run() -> list[SiteChunk]:
            try:
                assert await client.check_health()
                info = await client.info()
                assert (info.model, info.max_model_len) == ("m", 2048)
                return await collect(client, params(5))
            finally:
                await client.close()

        chunks = asyncio.run(run())
    assert chunks[0].accepted
    assert not chunks[0].token_ids
    assert "".join(c.text for c in chunks) == " w0 w1 w2 w3 w4"
    final = chunks[-1]
    assert (final.finish_reason, final.completion_tokens, final.prompt_tokens) == ("length", 5, 3)
    # Counted with the model's tokenizer where the engine gives no token ids.
    ids = [i for c in chunks for i in c.token_ids]
    assert tokenizers.decode("m", ids) == " w0 w1 w2 w3 w4"
    (sent,) = engine.state.requests
    assert sent["prompt"] == [10, 11, 12]
    assert sent["model"] == "served-model"
    assert sent["stream"] is True
    assert sent["return_token_ids"] is True
    assert client.ledger.report(None).running_requests == 0  # finished: out of the ledger


@pytest.mark.parametrize(
    ("behaviour", "error", "words"),
    [
        ("status:500", SiteUnavailable, "answered 500"),
        ("status:503", SiteUnavailable, "answered 503"),
        ("status:429", SiteBusy, "overloaded"),
        ("status:400", SiteRejected, "the engine says no"),
        ("status:401", SiteUnavailable, "API key"),
        ("malformed", SiteFailed, "malformed event stream"),
        ("drop", SiteFailed, "connection broke mid-answer"),
        ("abort", SiteFailed, "'abort'"),
    ],
)
def test_engine_failures_become_the_interfaces_failures(
    tokenizers, behaviour: str, error: type[Exception], words: str
) -> None:
    with running_engine(EngineState(behaviour=behaviour)) as engine:
        client = client_for(engine, tokenizers)

        async def run() -> None:
            try:
                await collect(client, params(5))
            finally:
                await client.close()

        with pytest.raises(error, match=words) as caught:
            asyncio.run(run())
    if isinstance(caught.value, SiteFailed):
        assert client.ledger.report(None).queued_requests == 0


def test_a_model_the_engine_does_not_serve_makes_the_site_unavailable(tokenizers) -> None:
    with running_engine() as engine:
        client = client_for(engine, tokenizers, engine_model="other-model")

        async def run() -> None:
            try:
                with pytest.raises(SiteUnavailable, match="does not serve model 'other-model'"):
                    await client.info()
                with pytest.raises(SiteUnavailable, match="does not serve model"):
                    await collect(client, params())
            finally:
                await client.close()

        asyncio.run(run())


def test_an_unreachable_engine_is_unhealthy_and_unavailable(tokenizers) -> None:
    config = OpenAISiteConfig(base_url=f"http://127.0.0.1:{free_port()}/v1", engine_model="x")
    client = OpenAISiteClient("ext", "m", config, tokenizers, connect_timeout_s=1.0)

    async def run() -> None:
        try:
            assert not await client.check_health()
            with pytest.raises(SiteUnavailable, match="unreachable"):
                await collect(client, params())
        finally:
            await client.close()

    asyncio.run(run())


def test_cancel_closes_the_upstream_stream(tokenizers) -> None:
    with running_engine(EngineState(token_delay_s=0.05)) as engine:
        client = client_for(engine, tokenizers)

        async def run() -> list[SiteChunk]:
            chunks: list[SiteChunk] = []
            try:
                async with aclosing(client.generate(params(200), 10.0)) as stream:
                    async for chunk in stream:
                        chunks.append(chunk)
                        if len(chunks) == 3:
                            assert await client.cancel("r1")
                return chunks
            finally:
                await client.close()

        chunks = asyncio.run(run())
        deadline = time.monotonic() + 5
        while engine.state.disconnected == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # the engine notices the closed connection at its next write
        assert engine.state.disconnected == 1
        assert engine.state.finished == 0
    assert chunks[-1].finish_reason == "cancelled"
    assert len(chunks) < 20


async def first_reports(client: OpenAISiteClient, count: int) -> list[LoadView]:
    reports = []
    async with aclosing(client.load_reports(100)) as stream:
        async for report in stream:
            reports.append(report)
            if len(reports) == count:
                break
    return reports


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_load_reports_carry_the_engines_metrics(tokenizers, dialect: str) -> None:
    state = EngineState(dialect=dialect, running=3, waiting=5, kv_usage=0.25, kv_blocks=1000,
                        generated_total=1000.0, gen_throughput=420.0)  # fmt: skip
    with running_engine(state) as engine:
        client = client_for(engine, tokenizers)

        async def run() -> list[LoadView]:
            try:
                first = await first_reports(client, 1)
                state.generated_total += 500.0  # the engine produced 500 tokens since
                await asyncio.sleep(0.5)
                return first + await first_reports(client, 1)
            finally:
                await client.close()

        first, later = asyncio.run(run())
    assert (first.queued_requests, first.running_requests) == (5, 3)
    assert first.kv_blocks_total == 16000  # vLLM: blocks x block size; SGLang: its pool
    assert first.running_tokens == 4000 == first.kv_blocks_used  # 25% of the pool
    if dialect == "sglang":
        assert later.decode_tokens_per_s == 420.0  # the engine's own gauge
    else:
        assert 500 < later.decode_tokens_per_s < 5000  # from the counter's increase


def test_metrics_that_cannot_be_read_break_the_report_stream(tokenizers) -> None:
    with running_engine(EngineState(metrics_status=500)) as engine:
        client = client_for(engine, tokenizers)

        async def run() -> None:
            try:
                await first_reports(client, 10)
            finally:
                await client.close()

        with pytest.raises(SiteUnavailable, match="metrics unreadable"):
            asyncio.run(run())


def test_the_ledger_counts_what_is_sent_and_streaming(tokenizers) -> None:
    state = EngineState(dialect="vllm", token_delay_s=0.05)
    with running_engine(state) as engine:
        client = client_for(engine, tokenizers)

        async def run() -> tuple[LoadView, int]:
            try:
                async with aclosing(client.generate(params(100), 10.0)) as stream:
                    async for chunk in stream:
                        if chunk.token_ids:
                            return client.ledger.report(None), len(chunk.token_ids)
                raise AssertionError("no tokens")
            finally:
                await client.close()

        report, produced = asyncio.run(run())
    # One request streaming: its prompt and tokens so far held, 4 predicted less those left.
    assert report.running_requests == 1
    assert report.queued_requests == 0
    assert produced == 2  # " w0": two GPT-2 tokens, as the gateway counts them
    assert report.predicted_remaining_tokens == 4 - produced
    assert report.running_tokens == 3 + produced


def test_an_engines_lora_adapters_are_its_sites_and_a_request_names_its_adapter(
    tokenizers,
) -> None:
    with running_engine(EngineState(adapters=("ft-b", "ft-a"))) as engine:
        client = client_for(engine, tokenizers)

        async def run() -> tuple[tuple[str, ...], list[SiteChunk]]:
            try:
                info = await client.info()
                tuned = GenerateParams("r-ft", (10, 11), 2, RequestOptions(adapter="ft-a"))
                return info.adapters, await collect(client, tuned)
            finally:
                await client.close()

        adapters, chunks = asyncio.run(run())
    assert adapters == ("ft-a", "ft-b")
    assert chunks[-1].finish_reason == "length"
    assert engine.state.requests[-1]["model"] == "ft-a"  # vLLM's way: the adapter is the model


def test_adapters_load_and_unload_through_vllms_endpoints_where_enabled(
    tokenizers: ModelTokenizers,
) -> None:
    with running_engine(EngineState(adapters=("ft-a",))) as engine:

        async def run() -> list[object]:
            seen: list[object] = []
            enabled = client_for(engine, tokenizers, dynamic_lora=True)
            disabled = client_for(engine, tokenizers)
            try:
                seen.append(await enabled.load_adapter("ft-b", "/loras/ft-b"))
                for call in (
                    enabled.load_adapter("ft-b", "/loras/ft-b"),  # already loaded
                    enabled.unload_adapter("nope"),
                    disabled.load_adapter("ft-c", "/loras/ft-c"),
                ):
                    with pytest.raises(AdapterChangeRefused) as refused:
                        await call
                    seen.append(refused.value.reason)
                seen.append(await enabled.unload_adapter("ft-a"))
                seen.append((await enabled.info()).adapters)
            finally:
                await enabled.close()
                await disabled.close()
            return seen

        seen = asyncio.run(run())
    assert seen == [
        ("ft-a", "ft-b"), "exists", "not_found", "unsupported", ("ft-b",), ("ft-b",),
    ]  # fmt: skip
    assert engine.state.adapters == ("ft-b",)  # the disabled client changed nothing
