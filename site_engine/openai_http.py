"""The site engine's OpenAI-compatible HTTP face (SITE_HTTP_PORT): `/v1/completions`,
`/v1/chat/completions` (both with `stream`), `/v1/models` and `/metrics`, served next to the
gRPC port by the same process and the same EngineService. (A site whose model is an embedding
model serves `/v1/embeddings` instead: site_engine/embedding_http.py.)

So a site can be used on its own like `vllm serve`, and a gateway can reach it as a site of kind
`openai` (gateway/sites/openai_client.py). Its /metrics publishes the engine's load under vLLM's
documented names (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, `vllm:generation_tokens_total`, `vllm:cache_config_info`,
`vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total`, in tokens), so the
gateway reads it with the `vllm` metrics dialect. Errors have OpenAI's shape.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import uvicorn
from litestar import Litestar, Request, Response, post
from litestar.response import Stream
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from site_engine.answer_stream import StreamEvent
from site_engine.engine.core.api import EngineRequest, RequestRejected
from site_engine.engine_service import EngineFailure, EngineService, QueueFull
from site_engine.http_common import common_routes
from site_engine.openai_wire import (
    Answer,
    BadRequest,
    FaceRequest,
    WholeChoice,
    error_body,
    parse_request,
)

log = logging.getLogger(__name__)


class VllmNamedMetrics(Collector):
    """The engine's load under vLLM's metric names, read from the service at each scrape."""

    def __init__(self, service: EngineService, model: str) -> None:
        self._service = service
        self._model = model

    def collect(self) -> Iterator[Metric]:
        stats, limits = self._service.stats(), self._service.engine.limits
        label = [self._model]
        usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch", stats.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled", stats.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(label, float(value))
            yield gauge
        for name, doc, total in (
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                self._service.generated_tokens_total(),
            ),
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                stats.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                stats.prefix_cache_hits,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(label, float(total))
            yield counter
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks"],
        )
        info.add_metric([str(limits.kv_block_size), str(limits.kv_blocks_total)], 1.0)
        yield info


def _error(exc: BadRequest) -> Response[Any]:
    kind = "NotFoundError" if exc.status == 404 else "invalid_request_error"
    return Response(error_body(str(exc), kind, exc.param), status_code=exc.status)


def _sse(obj: object) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class HttpFace:
    def __init__(self, service: EngineService, model: str, vocab_size: int) -> None:
        self._service = service
        self._model = model
        self._vocab = vocab_size
        self.registry = CollectorRegistry()
        self.registry.register(VllmNamedMetrics(service, model))

    def app(self) -> Litestar:
        @post("/v1/completions", status_code=200)
        async def completions(request: Request[Any, Any, Any]) -> Response[Any] | Stream:
            return await self._serve(request, chat=False)

        @post("/v1/chat/completions", status_code=200)
        async def chat(request: Request[Any, Any, Any]) -> Response[Any] | Stream:
            return await self._serve(request, chat=True)

        @post("/v1/embeddings", status_code=200)
        async def embeddings() -> Response[Any]:
            return _error(BadRequest(
                f"model {self._model} is a generative model: it does not serve /v1/embeddings",
                "model"))  # fmt: skip

        routes = common_routes(
            self._model, lambda: self._service.engine.limits.max_model_len, self.registry
        )
        return Litestar([*routes, completions, chat, embeddings])

    async def _serve(self, request: Request[Any, Any, Any], chat: bool) -> Response[Any] | Stream:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(BadRequest("the body is not JSON"))
        tokenizer = self._service.tokenizer
        try:
            face = parse_request(body, self._model, tokenizer, self._vocab, chat)
        except BadRequest as exc:
            return _error(exc)
        events = self._service.generate(
            EngineRequest(f"http-{uuid.uuid4().hex}", face.prompt_token_ids, face.sampling),
            face.sampling.stop,
            face.n,
        )
        try:
            await anext(events)  # the engine took it (or refused it: answered here, not mid-SSE)
        except (RequestRejected, ValueError) as exc:
            return _error(BadRequest(str(exc)))
        except QueueFull as exc:
            return Response(error_body(str(exc), "server_overloaded"), status_code=429)
        answer = Answer(face, self._model)
        if face.stream:
            return Stream(self._stream(events, answer, face), media_type="text/event-stream")
        return await self._whole(events, answer)

    async def _stream(
        self, events: AsyncIterator[StreamEvent], answer: Answer, face: FaceRequest
    ) -> AsyncIterator[str]:
        tokens = cached = 0
        if face.chat:
            for index in range(face.n):
                role = {"index": index, "delta": {"role": "assistant"}, "finish_reason": None}
                yield _sse({**answer.chunk("", (), None), "choices": [role]})
        try:
            async for event in events:
                tokens, cached = event.completion_tokens, event.cached_prompt_tokens
                reason = event.finish_reason.value if event.finish_reason else None
                if event.text or event.token_ids or reason:
                    yield _sse(answer.chunk(event.text, event.token_ids, reason, event.index,
                                            event.logprobs))  # fmt: skip
        except RequestRejected as exc:  # its constraint failed it after the first event
            yield _sse(error_body(str(exc), "invalid_request_error"))
            return
        except EngineFailure as exc:
            yield _sse(error_body(str(exc), "internal_error"))
            return
        if face.include_usage:
            yield _sse(answer.usage_chunk(tokens, cached))
        yield "data: [DONE]\n\n"

    async def _whole(self, events: AsyncIterator[StreamEvent], answer: Answer) -> Response[Any]:
        choices = [WholeChoice() for _ in range(answer.request.n)]
        tokens = cached = 0
        try:
            async for event in events:
                choice = choices[event.index]
                choice.text += event.text
                choice.ids.extend(event.token_ids)
                choice.logprobs.extend(event.logprobs)
                tokens, cached = event.completion_tokens, event.cached_prompt_tokens
                if event.finish_reason is not None:
                    choice.reason = event.finish_reason.value
        except RequestRejected as exc:
            return _error(BadRequest(str(exc)))
        except EngineFailure as exc:
            return Response(error_body(str(exc), "internal_error"), status_code=500)
        return Response(answer.whole(choices, tokens, cached), status_code=200)


class Face(Protocol):
    """An OpenAI-compatible face: HttpFace here, EmbeddingFace for an embedding model."""

    def app(self) -> Litestar: ...


@dataclass(slots=True)
class HttpServer:
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve_http(face: Face, host: str, port: int, timeout_s: float = 30.0) -> HttpServer:
    """Serves the face on host:port from a thread of its own (its own event loop: the engine
    service takes calls from any loop), so its requests and the gRPC server's never wait on
    each other's loop; returns once it listens."""
    config = uvicorn.Config(face.app(), host=host, port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="http-face", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise OSError(f"the HTTP face could not listen on {host}:{port}")
        time.sleep(0.02)
    return HttpServer(server, thread)
