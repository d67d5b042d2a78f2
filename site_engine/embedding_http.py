"""The OpenAI-compatible HTTP face of a site that serves an embedding model (SITE_HTTP_PORT):
`POST /v1/embeddings`, `/v1/models`, `/health` and `/metrics`, next to the gRPC port and over the
same batcher, so the site can be used on its own like `vllm serve --task embed` and a gateway can
reach it as a site of kind `openai`.

`input` takes the four forms OpenAI's does (a string, a list of strings, a list of token ids, a
list of token-id lists); strings are tokenized as the model's tokenizer does by default (its
special tokens around them), token ids are embedded as given. `encoding_format` is `float` or
`base64` (the float32 little-endian bytes); `dimensions` other than the model's own is refused.
Its /metrics carries vLLM's names for the request gauges and the prompt-token counter.
"""

from __future__ import annotations

import base64
import json
import uuid
from array import array
from collections.abc import Iterator
from typing import Any

from litestar import Litestar, Request, Response, post
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from transformers import PreTrainedTokenizerBase

from site_engine.embedding.batcher import EmbeddingBatcher, InvalidEmbedRequest
from site_engine.engine_service import EngineFailure, QueueFull
from site_engine.http_common import common_routes
from site_engine.openai_wire import BadRequest, error_body

_FORMATS = ("float", "base64")


class EmbeddingMetrics(Collector):
    """The batcher's load under vLLM's names, read at each scrape."""

    def __init__(self, batcher: EmbeddingBatcher, model: str) -> None:
        self._batcher = batcher
        self._model = model

    def collect(self) -> Iterator[Metric]:
        stats = self._batcher.stats()
        label = [self._model]
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests being embedded", stats.running_requests),
            ("vllm:num_requests_waiting", "Requests waiting to be embedded", stats.queued_requests),
            ("vllm:kv_cache_usage_perc", "KV-cache usage (an embedding model has none).", 0),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(label, float(value))
            yield gauge
        counter = CounterMetricFamily(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels=["model_name"]
        )
        counter.add_metric(label, float(stats.tokens_total))
        yield counter


def _error(exc: BadRequest) -> Response[Any]:
    kind = "NotFoundError" if exc.status == 404 else "invalid_request_error"
    return Response(error_body(str(exc), kind, exc.param), status_code=exc.status)


def parse_inputs(value: object, tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """OpenAI's four forms of `input` as token-id lists."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise BadRequest("input must be a string or a non-empty list", "input")
    if all(isinstance(item, str) for item in value):
        ids: list[list[int]] = tokenizer(value, add_special_tokens=True)["input_ids"]
        return ids
    if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return [list(value)]
    if all(
        isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item)
        for item in value
    ):
        return [list(item) for item in value]
    raise BadRequest(
        "input must be a string, a list of strings, a list of token ids or a list of "
        "token-id lists",
        "input",
    )


def _encoded(vector: bytes, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector).decode()
    return array("f", vector).tolist()


class EmbeddingFace:
    def __init__(self, batcher: EmbeddingBatcher, tokenizer: PreTrainedTokenizerBase,
                 model: str, dimension: int) -> None:  # fmt: skip
        self._batcher = batcher
        self._tokenizer = tokenizer
        self._model = model
        self._dimension = dimension
        self.registry = CollectorRegistry()
        self.registry.register(EmbeddingMetrics(batcher, model))

    def app(self) -> Litestar:
        @post("/v1/embeddings", status_code=200)
        async def embeddings(request: Request[Any, Any, Any]) -> Response[Any]:
            try:
                return await self._serve(await request.body())
            except BadRequest as exc:
                return _error(exc)

        @post(["/v1/completions", "/v1/chat/completions"], status_code=200)
        async def generate() -> Response[Any]:
            return _error(BadRequest(
                f"model {self._model} is an embedding model: it serves /v1/embeddings only",
                "model"))  # fmt: skip

        routes = common_routes(self._model, lambda: self._batcher.max_seq_length, self.registry)
        return Litestar([*routes, embeddings, generate])

    def _body(self, raw: bytes) -> dict[str, Any]:
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise BadRequest("the body is not JSON") from exc
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        if body.get("model") != self._model:
            raise BadRequest(f"The model `{body.get('model')}` does not exist.", "model", 404)
        if body.get("encoding_format", "float") not in _FORMATS:
            raise BadRequest(f"encoding_format must be one of {list(_FORMATS)}", "encoding_format")
        if body.get("dimensions") not in (None, self._dimension):
            raise BadRequest(
                f"model {self._model} gives {self._dimension}-dimensional vectors and cannot "
                "shorten them",
                "dimensions",
            )
        return body

    async def _serve(self, raw: bytes) -> Response[Any]:
        body = self._body(raw)
        inputs = parse_inputs(body.get("input"), self._tokenizer)
        try:
            output = await self._batcher.embed(f"http-{uuid.uuid4().hex}", inputs)
        except InvalidEmbedRequest as exc:
            raise BadRequest(str(exc), "input") from exc
        except QueueFull as exc:
            return Response(error_body(str(exc), "server_overloaded"), status_code=429)
        except EngineFailure as exc:
            return Response(error_body(str(exc), "internal_error"), status_code=500)
        encoding = body.get("encoding_format", "float")
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(vector, encoding)}
            for i, vector in enumerate(output.vectors)
        ]
        usage = {"prompt_tokens": output.prompt_tokens, "total_tokens": output.prompt_tokens}
        return Response(
            {"object": "list", "data": data, "model": self._model, "usage": usage},
            status_code=200,
        )
