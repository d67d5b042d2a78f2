"""A site serving all-MiniLM-L6-v2 over real gRPC on loopback, in this process: the runner's
vectors against sentence-transformers', concurrent requests sharing forward passes, the Embed
contract through the gateway's GrpcSiteClient, and the gateway's embeddings path failing over
from a site that went away and recording the request."""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
from litestar.testing import TestClient
from sqlalchemy import create_engine, text

from fedllm_contract.request_options import RequestOptions
from fedllm_contract.tokenizer import tokenizer_fingerprint
from gateway.db.migrate import sync_url, upgrade
from gateway.db.session import create_engine as create_async_engine
from gateway.db.session import create_sessionmaker
from gateway.embeddings.prepare import EmbeddingPreparer
from gateway.embeddings.request import EmbeddingRequest
from gateway.embeddings.route import EmbeddingRouter
from gateway.embeddings.service import EmbeddingService
from gateway.federation import ModelConfig, ModelTask, SiteConfig
from gateway.metrics import GatewayMetrics
from gateway.request_path.admit import Admitter
from gateway.request_path.record import RequestRecords
from gateway.settings import GatewaySettings
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.health import HealthMonitor
from gateway.sites.interface import EmbedParams, GenerateParams, SiteRejected
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.stores.request_log import RequestLog
from gateway.stores.site_store import sync_sites
from gateway.tokenizers import ModelTokenizers
from site_engine.embedding.batcher import EmbeddingBatcher, EmbeddingLimits
from site_engine.embedding.runner import EmbeddingRunner, load_embedding_runner
from site_engine.embedding_http import EmbeddingFace
from site_engine.grpc_embedding import EmbeddingServicer
from site_engine.grpc_server import SiteIdentity, start_server

pytestmark = pytest.mark.slow
TEXTS = ["The cat sat on the mat.", "Vectors, not words.", "a", "Ten little words " * 5]


@pytest.fixture(scope="module")
def runner(minilm_dir: Path) -> EmbeddingRunner:
    return load_embedding_runner(minilm_dir)


def ids_of(runner: EmbeddingRunner, texts: Sequence[str]) -> list[list[int]]:
    ids: list[list[int]] = runner.tokenizer(list(texts))["input_ids"]
    return ids


def floats(vectors: Sequence[bytes]) -> np.ndarray:
    return np.stack([np.frombuffer(v, dtype="<f4") for v in vectors])


def test_one_padded_pass_gives_sentence_transformers_vectors(
    runner: EmbeddingRunner, minilm_dir: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm_dir), device="cpu").encode(TEXTS)
    ours = floats(runner.embed(ids_of(runner, TEXTS)))  # rows of four lengths, padded together
    assert ours.shape == (len(TEXTS), 384)
    np.testing.assert_allclose(ours, reference, atol=2e-6)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)


class GatedRunner:
    """The real runner; its first pass waits until the test opens the gate, and every pass's
    size is kept, so a test sees which inputs went through together."""

    def __init__(self, runner: EmbeddingRunner) -> None:
        self._runner = runner
        self.entered, self.gate = threading.Event(), threading.Event()
        self.passes: list[int] = []

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[bytes]:
        self.entered.set()
        self.gate.wait(30)
        self.passes.append(len(inputs))
        return self._runner.embed(inputs)


async def _until(condition: object, what: str) -> None:
    for _ in range(600):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize(("max_inputs", "passes"), [(32, [1, 10]), (4, [1, 4, 4, 2])])
def test_requests_that_arrive_during_a_pass_share_the_next_ones(
    runner: EmbeddingRunner, max_inputs: int, passes: list[int]
) -> None:
    gated = GatedRunner(runner)
    batcher = EmbeddingBatcher(
        gated, EmbeddingLimits(max_inputs, 8192), runner.layout.max_seq_length, runner.vocab_size
    )
    inputs = ids_of(runner, TEXTS[:2])

    async def run() -> None:
        first = asyncio.create_task(batcher.embed("first", inputs[:1]))
        await _until(gated.entered.is_set, "the first pass")
        others = [asyncio.create_task(batcher.embed(f"r{i}", inputs)) for i in range(5)]
        await _until(lambda: batcher.stats().queued_requests == 5, "five queued requests")
        assert batcher.stats().queued_tokens == 5 * sum(map(len, inputs))
        gated.gate.set()
        results = await asyncio.gather(first, *others)
        alone = floats(runner.embed(inputs))
        for result in results[1:]:
            np.testing.assert_allclose(floats(result.vectors), alone, atol=1e-5)
            assert result.prompt_tokens == sum(map(len, inputs))
        assert batcher.stats().queued_requests == batcher.stats().running_requests == 0

    batcher.start()
    try:
        asyncio.run(run())
    finally:
        batcher.stop()
    assert gated.passes == passes


def test_the_sites_openai_face_serves_embeddings(runner: EmbeddingRunner) -> None:
    """The face `--http-port` serves for an embedding model: what an `openai` site is sent."""
    batcher = EmbeddingBatcher(
        runner, EmbeddingLimits(8, 4096), runner.layout.max_seq_length, runner.vocab_size
    )
    face = EmbeddingFace(batcher, runner.tokenizer, "minilm", 384)
    expected = floats(runner.embed(ids_of(runner, TEXTS[:2])))
    batcher.start()
    try:
        with TestClient(face.app()) as http:
            floated = http.post("/v1/embeddings", json={"model": "minilm", "input": TEXTS[:2]})
            data = floated.json()["data"]
            np.testing.assert_allclose([d["embedding"] for d in data], expected, atol=1e-5)
            usage = floated.json()["usage"]
            assert usage["prompt_tokens"] == sum(map(len, ids_of(runner, TEXTS[:2])))
            ids = ids_of(runner, TEXTS[:1])[0]
            for form in (ids, [ids], TEXTS[0]):
                b64 = http.post("/v1/embeddings", json={
                    "model": "minilm", "input": form, "encoding_format": "base64"})  # fmt: skip
                vector = np.frombuffer(base64.b64decode(b64.json()["data"][0]["embedding"]), "<f4")
                np.testing.assert_allclose(vector, expected[0], atol=1e-5)
            for body, status, says in (
                ({"model": "other", "input": "x"}, 404, "does not exist"),
                ({"model": "minilm", "input": "x", "dimensions": 5}, 400, "cannot shorten"),
                ({"model": "minilm", "input": [1, "x"]}, 400, "input must be"),
                ({"model": "minilm", "input": [[101] * 300]}, 400, "reads at most 256"),
                ({"model": "minilm", "input": [[101, -5, 102]]}, 400, "outside [0, 30522)"),
            ):
                refused = http.post("/v1/embeddings", json=body)
                assert refused.status_code == status, refused.text
                assert says in refused.json()["error"]["message"]
            chat = http.post("/v1/chat/completions", json={"model": "minilm", "messages": []})
            assert "is an embedding model" in chat.json()["error"]["message"]
            assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 256
            assert 'vllm:num_requests_waiting{model_name="minilm"} 0.0' in http.get("/metrics").text
    finally:
        batcher.stop()


@asynccontextmanager
async def embedding_site(
    runner: EmbeddingRunner, name: str
) -> AsyncIterator[tuple[int, grpc.aio.Server]]:
    """An embedding site on a free loopback port, as `python -m site_engine` builds it: its
    port and its server."""
    batcher = EmbeddingBatcher(
        runner, EmbeddingLimits(8, 4096), runner.layout.max_seq_length, runner.vocab_size
    )
    fingerprint = tokenizer_fingerprint(runner.tokenizer)
    identity = SiteIdentity(
        name, "minilm", runner.vocab_size, fingerprint, "cpu", "float32", "test"
    )
    batcher.start()
    server, _, port = await start_server(EmbeddingServicer(batcher, identity, 384), "127.0.0.1", 0)
    try:
        yield port, server
    finally:
        await server.stop(None)
        batcher.stop()


def test_the_embed_contract_through_the_gateways_grpc_client(runner: EmbeddingRunner) -> None:
    inputs = tuple(tuple(ids) for ids in ids_of(runner, TEXTS))

    async def run() -> None:
        async with embedding_site(runner, "e1") as (port, _):
            client = GrpcSiteClient("e1", f"127.0.0.1:{port}", 5.0)
            try:
                info = await client.info()
                assert (info.task, info.embedding_dimension, info.max_model_len) == (
                    "embed",
                    384,
                    256,
                )
                assert (info.kv_blocks_total, info.model) == (0, "minilm")
                result = await client.embed(EmbedParams("x1", inputs), 30)
                np.testing.assert_allclose(
                    floats(result.vectors), floats(runner.embed(inputs)), atol=1e-5
                )
                assert result.prompt_tokens == sum(map(len, inputs))
                for bad, says in (
                    (EmbedParams("x2", inputs, dimensions=100), "cannot shorten them"),
                    (EmbedParams("x3", ((101,) * 300,)), "reads at most 256"),
                    (EmbedParams("x4", ((runner.vocab_size,),)), "outside \\[0, 30522\\)"),
                ):
                    with pytest.raises(SiteRejected, match=says):
                        await client.embed(bad, 30)
                with pytest.raises(SiteRejected, match="does not generate"):
                    async for _ in client.generate(
                        GenerateParams("g1", (101,), 4, RequestOptions(temperature=0)), 30
                    ):
                        pass
                report = await anext(client.load_reports(50))
                assert report.iterations >= 1  # the passes made so far
                assert report.kv_blocks_total == 0
                await _health_checks_the_task(port)
            finally:
                await client.close()

    asyncio.run(run())


async def _health_checks_the_task(port: int) -> None:
    """A site whose model's task is not the federation file's is unhealthy, saying so."""
    checks: tuple[tuple[ModelTask, bool], ...] = (("embed", True), ("generate", False))
    for task, healthy in checks:
        config = SiteConfig("e1", "aws", "us-east-1", f"127.0.0.1:{port}", "minilm")
        site = SiteState(config, 1, GrpcSiteClient("e1", config.endpoint, 5.0))
        monitor = HealthMonitor(SiteRegistry([site]), {}, 60, tasks={"minilm": task})
        try:
            await monitor.check_once()
        finally:
            await site.client.close()
        assert site.healthy is healthy, site.last_error
        if not healthy:
            assert site.last_error == (
                "its model 'minilm' has task 'embed' there, but task 'generate' in the "
                "federation file"
            )


def _site_state(name: str, port: int, site_id: int) -> SiteState:
    from gateway.sites.interface import SiteInfoView

    info = SiteInfoView(name, "minilm", 256, 30522, "f", "cpu", "float32", 1, 0, 8, "embedding",
                        "test", task="embed", embedding_dimension=384)  # fmt: skip
    config = SiteConfig(name, "aws", "us-east-1", f"127.0.0.1:{port}", "minilm")
    return SiteState(config, site_id, GrpcSiteClient(name, config.endpoint, 5.0), True, info)


def test_the_gateway_moves_a_request_off_a_site_that_went_away_and_records_it(
    runner: EmbeddingRunner, minilm_dir: Path, sqlite_url: str
) -> None:
    upgrade(sqlite_url)
    settings = GatewaySettings(federation_file=Path("unused.json"))

    async def run() -> None:
        engine = create_async_engine(sqlite_url)
        sessions = create_sessionmaker(engine)
        async with (
            embedding_site(runner, "a") as (port_a, server_a),
            embedding_site(runner, "b") as (port_b, _),
        ):
            ids = await sync_sites(sessions, tuple(
                SiteConfig(n, "aws", "us-east-1", f"127.0.0.1:{p}", "minilm")
                for n, p in (("a", port_a), ("b", port_b))))  # fmt: skip
            sites = [_site_state("a", port_a, ids["a"]), _site_state("b", port_b, ids["b"])]
            registry = SiteRegistry(sites)
            tokenizers = ModelTokenizers((ModelConfig("minilm", minilm_dir, task="embed"),))
            metrics = GatewayMetrics()
            records = RequestRecords(settings, RequestLog(sessions), metrics)
            service = EmbeddingService(
                EmbeddingPreparer(registry, tokenizers, ["minilm"], 64),
                EmbeddingRouter(registry, metrics),
                Admitter(16, records.writer),
                records,
                metrics,
                request_timeout_s=30,
            )
            await server_a.stop(None)  # site a is gone, the gateway not told yet
            inputs: list[str | int | list[int]] = list(TEXTS)
            prepared = service.prepare(EmbeddingRequest(model="minilm", input=inputs))
            embedded = await service.embed(prepared, None)
            assert embedded.site == "b"
            assert not sites[0].healthy
            assert [(s.in_flight, s.ledger_tokens) for s in sites] == [(0, 0), (0, 0)]
            await records.writer.flush()
            await records.drain()
            await registry.close()
        await engine.dispose()
        assert np.allclose(floats(embedded.result.vectors),
                           floats(runner.embed(prepared.params.inputs)), atol=1e-5)  # fmt: skip

    asyncio.run(run())
    with create_engine(sync_url(sqlite_url)).connect() as connection:
        row = connection.execute(text(
            "SELECT r.api, r.status, r.attempts, r.prompt_tokens, r.completion_tokens, s.name "
            "FROM requests r JOIN sites s ON s.id = r.site_id")).one()  # fmt: skip
    prompt = sum(map(len, ids_of(runner, TEXTS)))
    assert tuple(row) == ("embeddings", "completed", 2, prompt, 0, "b")
