"""The gateway's adapter to an OpenAI-compatible engine (vLLM, SGLang, TGI, our engine's HTTP
face): the second implementation of SiteClient (gateway/sites/interface.py), over httpx.

What it cannot do: hand back queued work (the engine owns its queue), so `can_release_queued`
is False and offload and drains never ask it to. Its load reports are built by the gateway from
its own ledger and the engine's scraped metrics (openai_ledger.py), not pushed by the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator
from typing import Any

import httpx

from gateway.federation import ModelTask, OpenAISiteConfig
from gateway.sites.engine_metrics import EngineMetrics, MetricsFormatError, parse_engine_metrics
from gateway.sites.interface import (
    EmbedParams,
    EmbedResult,
    GenerateParams,
    LoadView,
    SiteCallError,
    SiteChunk,
    SiteFailed,
    SiteInfoView,
    SiteTimedOut,
    SiteUnavailable,
)
from gateway.sites.openai_ledger import OpenAILedger
from gateway.sites.openai_lora import change_adapter, not_enabled
from gateway.sites.openai_wire import (
    DONE,
    MalformedStream,
    StreamEvent,
    capabilities,
    completion_body,
    embedding_body,
    http_failure,
    is_finished,
    parse_embeddings,
    parse_event,
    sse_data,
)
from gateway.tokenizers import ModelTokenizers

# Batch slots assumed when neither the federation file nor the engine says (vLLM's default).
DEFAULT_MAX_NUM_SEQS = 256
# Scrapes that fail in a row before the load-report stream counts as broken (the site then goes
# unhealthy once its reports are stale, as a gRPC site whose stream stops).
_SCRAPE_FAILURES = 3


def _json_or_text(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def read_api_key(config: OpenAISiteConfig) -> str | None:
    """The key in the site's secret file (its first line), read once at start-up; an unreadable
    or empty file stops the start, naming the file."""
    if config.api_key_file is None:
        return None
    try:
        key = config.api_key_file.read_text().strip().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read API key file {config.api_key_file}: {exc}") from exc
    if not key or not key[0].strip():
        raise ValueError(f"API key file {config.api_key_file} is empty")
    return key[0].strip()


class OpenAISiteClient:
    """A site served by an OpenAI-compatible engine at `config.base_url`."""

    can_release_queued = False

    def __init__(
        self,
        name: str,
        model: str,
        config: OpenAISiteConfig,
        tokenizers: ModelTokenizers,
        connect_timeout_s: float,
        transport: httpx.AsyncBaseTransport | None = None,
        task: ModelTask = "generate",
    ) -> None:
        """`task`: what the gateway's model does (the federation file's), which an
        OpenAI-compatible engine does not say: an embedding model's site is sent /v1/embeddings."""
        self.name = name
        self.task = task
        self.endpoint = config.base_url
        self._model = model
        self._config = config
        self._tokenizers = tokenizers
        self._timeout = connect_timeout_s
        key = read_api_key(config)
        self._http = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {key}"} if key else {},
            timeout=connect_timeout_s,
            transport=transport,
        )
        self.ledger = OpenAILedger()
        self.capabilities = capabilities(config.structured_outputs)
        self._models: dict[str, dict[str, Any]] | None = None
        self._open: dict[str, httpx.Response] = {}
        self._cancelled: set[str] = set()

    # ---- health and identity ------------------------------------------------------------------
    async def check_health(self) -> bool:
        """The engine answers /v1/models (the call every OpenAI-compatible server has)."""
        try:
            response = await self._http.get(f"{self.endpoint}/models")
            body = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return False
        cards = body.get("data") if isinstance(body, dict) else None
        if not isinstance(cards, list):
            return False
        self._models = {c["id"]: c for c in cards if isinstance(c, dict) and "id" in c}
        return True

    async def info(self) -> SiteInfoView:
        if self._models is None and not await self.check_health():
            raise SiteUnavailable(self.name, "the engine does not answer /v1/models")
        cards = self._models or {}
        card = cards.get(self._config.engine_model)
        if card is None:
            raise SiteUnavailable(
                self.name,
                f"the engine does not serve model {self._config.engine_model!r} "
                f"(it serves {sorted(cards)})",
            )
        context = self._config.max_model_len or card.get("max_model_len")
        if not isinstance(context, int) or context < 1:
            raise SiteUnavailable(
                self.name, "the engine does not say its context length: set max_model_len"
            )
        return SiteInfoView(
            site_name=self.name,
            model=self._model,
            max_model_len=context,
            vocab_size=self._tokenizers.vocab_size(self._model),
            # Its tokens are counted with the model's tokenizer at the gateway: that is the one
            # whose fingerprint it carries.
            tokenizer_fingerprint=self._tokenizers.fingerprints[self._model],
            device="remote",
            dtype="",
            kv_block_size=1,
            kv_blocks_total=self.kv_capacity_tokens() or 0,
            max_num_seqs=self._config.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
            engine=f"openai ({self._config.metrics_dialect} metrics)",
            version="",
            task=self.task,
            adapters=self._adapters(cards),
        )

    def _adapters(self, cards: dict[str, dict[str, Any]]) -> tuple[str, ...]:
        """vLLM lists each LoRA adapter it serves as a model whose parent is its base."""
        engine_model = self._config.engine_model
        return tuple(sorted(name for name, c in cards.items() if c.get("parent") == engine_model))

    # ---- LoRA adapters at run time (AdapterLoading; gateway/sites/openai_lora.py) ------------
    async def load_adapter(self, name: str, path: str) -> tuple[str, ...]:
        return await self._change_adapter("load", {"lora_name": name, "lora_path": path})

    async def unload_adapter(self, name: str) -> tuple[str, ...]:
        return await self._change_adapter("unload", {"lora_name": name})

    async def _change_adapter(self, action: str, body: dict[str, str]) -> tuple[str, ...]:
        """The change, then the adapters the engine lists after it (its /v1/models again)."""
        if not self._config.dynamic_lora:
            raise not_enabled(self.name)
        await change_adapter(self._http, self.name, self.endpoint, action, body)
        if not await self.check_health():
            raise SiteUnavailable(self.name, "the engine does not answer /v1/models")
        return self._adapters(self._models or {})

    def kv_capacity_tokens(self) -> int | None:
        scraped = self.ledger.metrics
        return self._config.kv_capacity_tokens or (
            scraped.kv_capacity_tokens if scraped is not None else None
        )

    # ---- generation ---------------------------------------------------------------------------
    async def generate(
        self, params: GenerateParams, timeout_s: float
    ) -> AsyncGenerator[SiteChunk, None]:
        """Streams the engine's answer; closing the iterator closes the upstream stream, which
        OpenAI-compatible engines take as the request's cancellation."""
        request_id = params.request_id
        planned = params.predicted_tokens or params.max_tokens
        self.ledger.sent(request_id, len(params.prompt_token_ids), planned)
        accepted = False
        try:
            async for chunk in self._stream(params, timeout_s):
                accepted = True
                yield chunk
        except httpx.TimeoutException as exc:
            if accepted:
                raise SiteTimedOut(self.name, "the request's deadline passed") from exc
            raise SiteUnavailable(self.name, "did not answer in time") from exc
        except (httpx.TransportError, httpx.StreamError) as exc:
            if request_id in self._cancelled:
                yield self._final(params, "cancelled", 0)
                return
            if not accepted:
                raise SiteUnavailable(self.name, f"unreachable: {exc!r}") from exc
            raise SiteFailed(self.name, f"the connection broke mid-answer: {exc!r}") from exc
        except MalformedStream as exc:
            raise SiteFailed(self.name, f"malformed event stream: {exc}") from exc
        finally:
            self.ledger.done(request_id)
            self._cancelled.discard(request_id)
            self._open.pop(request_id, None)

    async def _stream(
        self, params: GenerateParams, timeout_s: float
    ) -> AsyncGenerator[SiteChunk, None]:
        config = self._config
        body = completion_body(
            params, config.engine_model, config.request_token_ids, config.structured_outputs
        )
        timeout = httpx.Timeout(timeout_s, connect=min(self._timeout, timeout_s))
        async with self._http.stream(
            "POST", f"{self.endpoint}/completions", json=body, timeout=timeout
        ) as response:
            if not response.is_success:
                raw = await response.aread()
                raise http_failure(
                    self.name, response.status_code, _json_or_text(raw), self._config.engine_model
                )
            self._open[params.request_id] = response
            yield self._final(params, None, 0)  # accepted: the engine took the request
            async for chunk in self._chunks(params, response, time.monotonic() + timeout_s):
                yield chunk

    async def _chunks(
        self, params: GenerateParams, response: httpx.Response, deadline: float
    ) -> AsyncGenerator[SiteChunk, None]:
        produced, usage = 0, None
        finishes: dict[int, str] = {}  # per choice
        async for data in sse_data(response.aiter_lines()):
            if data == DONE:
                break
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout("the request's deadline passed")
            event = parse_event(data)
            if event.finish_reason is not None and not is_finished(event.finish_reason):
                raise SiteFailed(
                    self.name, f"the engine ended the answer with {event.finish_reason!r}"
                )
            usage = event.completion_tokens if event.completion_tokens is not None else usage
            ids = self._token_ids(event)
            if ids or event.text:
                produced += len(ids)
                self.ledger.produced(params.request_id, len(ids))
                prompt = len(params.prompt_token_ids)
                yield SiteChunk(True, ids, event.text, None, prompt, produced,
                                index=event.index, logprobs=event.logprobs)  # fmt: skip
            if event.finish_reason is not None:
                finishes[event.index] = event.finish_reason
        if len(finishes) < params.options.n:
            raise MalformedStream("the stream ended before the answer did")
        # The engine's own count when it gave one (it includes an EOS and tokens a stop string
        # cut), else the tokens the gateway counted; the last choice's final chunk carries it.
        total = usage if usage is not None else produced
        for index, finish in sorted(finishes.items()):
            yield self._final(params, finish, total, index)

    def _token_ids(self, event: StreamEvent) -> tuple[int, ...]:
        if event.token_ids is not None:
            return event.token_ids
        return tuple(self._tokenizers.encode(self._model, event.text)) if event.text else ()

    def _final(
        self, params: GenerateParams, finish: str | None, tokens: int, index: int = 0
    ) -> SiteChunk:
        return SiteChunk(True, (), "", finish, len(params.prompt_token_ids), tokens, index=index)

    # ---- embeddings ---------------------------------------------------------------------------
    async def embed(self, params: EmbedParams, timeout_s: float) -> EmbedResult:
        """POST /v1/embeddings at the engine (vLLM and the others serve it for an embedding
        model), the inputs as the gateway tokenized them."""
        body = embedding_body(params, self._config.engine_model)
        timeout = httpx.Timeout(timeout_s, connect=min(self._timeout, timeout_s))
        self.ledger.sent(params.request_id, params.prompt_tokens, 0)
        try:
            response = await self._http.post(
                f"{self.endpoint}/embeddings", json=body, timeout=timeout
            )
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise SiteUnavailable(self.name, f"unreachable: {exc!r}") from exc
        except httpx.TimeoutException as exc:
            raise SiteTimedOut(self.name, "the request's deadline passed") from exc
        except httpx.TransportError as exc:
            raise SiteFailed(self.name, f"the connection broke: {exc!r}") from exc
        finally:
            self.ledger.done(params.request_id)
        answer = _json_or_text(response.content)
        if not response.is_success:
            raise http_failure(self.name, response.status_code, answer, self._config.engine_model)
        try:
            vectors = parse_embeddings(answer, len(params.inputs))
        except MalformedStream as exc:
            raise SiteFailed(self.name, f"malformed embeddings answer: {exc}") from exc
        # The gateway's count: the engine embedded exactly the token ids it was sent.
        return EmbedResult(vectors, params.prompt_tokens)

    async def cancel(self, request_id: str) -> bool:
        """Closes the request's upstream stream: the engine aborts it, its stream here ends
        with finish_reason "cancelled"."""
        response = self._open.get(request_id)
        if response is None:
            return False
        self._cancelled.add(request_id)
        await response.aclose()
        return True

    async def release_queued(self, max_requests: int) -> list[str]:
        raise SiteCallError(self.name, "an OpenAI-compatible engine cannot hand back queued work")

    # ---- load ---------------------------------------------------------------------------------
    async def load_reports(
        self, interval_ms: int, cache_events: bool = False
    ) -> AsyncGenerator[LoadView, None]:
        """A report every interval from the ledger and the last scrape; raises SiteUnavailable
        when the metrics could not be read _SCRAPE_FAILURES times in a row. No cache events:
        an OpenAI-compatible server does not say which blocks it holds."""
        del cache_events
        failures, scraped_at = 0, float("-inf")
        scrape_every_s = self._config.metrics_interval_ms / 1000
        while True:
            if self._config.metrics_url and time.monotonic() - scraped_at >= scrape_every_s:
                scraped_at = time.monotonic()
                try:
                    self.ledger.scraped(await self._scrape(self._config.metrics_url))
                    failures = 0
                except (httpx.HTTPError, MetricsFormatError) as exc:
                    failures += 1
                    if failures >= _SCRAPE_FAILURES:
                        raise SiteUnavailable(self.name, f"metrics unreadable: {exc}") from exc
            yield self.ledger.report(self.kv_capacity_tokens())
            await asyncio.sleep(interval_ms / 1000)

    async def _scrape(self, url: str) -> EngineMetrics:
        response = await self._http.get(url)
        response.raise_for_status()
        return parse_engine_metrics(
            response.text, self._config.metrics_dialect, self._config.engine_model
        )

    async def close(self) -> None:
        await self._http.aclose()
