"""From a validated completion request to a finished, recorded completion.

prepare() checks everything that can be checked without a site (so bad input changes nothing);
dispatch() routes and records the request; Dispatch.events() streams it from the chosen site,
moving it to another site if the first cannot take it before it starts, and records the outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Literal, Protocol

from gateway.api.errors import (
    OpenAIError,
    invalid_request,
    model_not_found,
    service_unavailable,
    upstream_failed,
)
from gateway.api.schemas import CompletionRequest
from gateway.db.models import RequestStatus, utcnow
from gateway.metrics import GatewayMetrics
from gateway.prediction import PredictorService
from gateway.routing.policy import RoutingPolicy
from gateway.routing.types import RoutingRequest
from gateway.services.request_log import NewRequest, NewSample, Outcome, RequestLog
from gateway.settings import GatewaySettings
from gateway.sites.client import (
    GenerateParams,
    SiteChunk,
    SiteFailed,
    SiteRejected,
    SiteUnavailable,
)
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.tokenizers import ModelTokenizers

log = logging.getLogger(__name__)
MAX_STOP_SEQUENCES = 4
# Stop strings are matched after every token; the site refuses longer ones (MAX_STOP_CHARS there).
MAX_STOP_CHARS = 1024
STOP_OR_LENGTH = ("stop", "length")
Api = Literal["completions", "chat.completions"]
_ID_PREFIX: dict[Api, str] = {"completions": "cmpl-", "chat.completions": "chatcmpl-"}


@dataclass(frozen=True, slots=True)
class Sampling:
    """The generation fields every API shares, as the client sent them (validated here)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | Sequence[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    # The wire name of the length limit the client used (chat has two), for error messages.
    max_tokens_param: str = "max_tokens"


@dataclass(frozen=True, slots=True)
class Delivery:
    """How the answer goes back and whom it is for."""

    stream: bool = False
    include_usage: bool = False
    user: str | None = None


class Admission(Protocol):
    """A caller's hold on its API key's limits (gateway/tenancy/admission.py): charged once the
    answer length is predicted, settled with the tokens the request really took."""

    @property
    def api_key_id(self) -> int | None: ...

    def charge(self, tokens: int) -> None: ...

    def settle(self, tokens: int) -> None: ...


@dataclass(frozen=True, slots=True)
class PreparedCompletion:
    request_id: str
    created: int
    model: str
    params: GenerateParams
    stream: bool
    include_usage: bool
    user: str | None
    # The prompt as text (decoded when it came as token ids): what the length predictor reads.
    prompt_text: str
    predicted_bucket: int | None = None
    api: Api = "completions"

    @property
    def routing(self) -> RoutingRequest:
        return RoutingRequest(
            model=self.model,
            prompt_tokens=len(self.params.prompt_token_ids),
            max_tokens=self.params.max_tokens,
            predicted_tokens=self.params.predicted_tokens,
            predicted_bucket=self.predicted_bucket,
        )


def _reject_unsupported(req: CompletionRequest) -> None:
    unsupported = {
        "n": req.n != 1,
        "best_of": req.best_of not in (None, 1),
        "logprobs": req.logprobs is not None,
        "echo": req.echo,
        "suffix": req.suffix is not None,
        "presence_penalty": req.presence_penalty != 0,
        "frequency_penalty": req.frequency_penalty != 0,
        "logit_bias": bool(req.logit_bias),
    }
    for param, used in unsupported.items():
        if used:
            raise invalid_request(f"'{param}' is not supported by this gateway", param=param)


class CompletionService:
    def __init__(
        self,
        settings: GatewaySettings,
        registry: SiteRegistry,
        tokenizers: ModelTokenizers,
        policy: RoutingPolicy,
        request_log: RequestLog,
        predictor: PredictorService | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.predictor = predictor or PredictorService(None)
        self.metrics = metrics or GatewayMetrics()
        self._registry = registry
        self._tokenizers = tokenizers
        self._policy = policy
        self.request_log = request_log
        self._background: set[asyncio.Task[None]] = set()

    def prepare(self, req: CompletionRequest) -> PreparedCompletion:
        """Validates and tokenizes; raises OpenAIError (4xx) without touching any state."""
        if req.model not in self._tokenizers:
            raise model_not_found(req.model)
        _reject_unsupported(req)
        prompt_ids, prompt_text = self._prompt(req)
        sampling = Sampling(
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            stop=req.stop,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
        )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        delivery = Delivery(stream=req.stream, include_usage=include_usage, user=req.user)
        return self.prepare_tokens(req.model, prompt_ids, prompt_text, sampling, delivery)

    def prepare_tokens(
        self,
        model: str,
        prompt_ids: Sequence[int],
        prompt_text: str,
        sampling: Sampling,
        delivery: Delivery,
        api: Api = "completions",
    ) -> PreparedCompletion:
        """Validates the sampling fields against an already tokenized prompt (what every API
        shares); raises OpenAIError (4xx) without touching any state. `prompt_text` is what the
        length predictor reads."""
        if model not in self._tokenizers:
            raise model_not_found(model)
        param = sampling.max_tokens_param
        max_tokens = self.settings.default_max_tokens
        if sampling.max_tokens is not None:
            max_tokens = sampling.max_tokens
        if max_tokens < 1:
            raise invalid_request(f"{param} must be at least 1", param=param)
        context = self._registry.max_model_len(model)
        if context is not None and len(prompt_ids) + max_tokens > context:
            raise invalid_request(
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the "
                f"prompt, {max_tokens} for the completion).",
                param=param,
                code="context_length_exceeded",
            )
        stop = (sampling.stop,) if isinstance(sampling.stop, str) else tuple(sampling.stop or ())
        if len(stop) > MAX_STOP_SEQUENCES or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stop):
            raise invalid_request(
                f"stop takes up to 4 non-empty strings of up to {MAX_STOP_CHARS} characters",
                param="stop",
            )
        if sampling.seed is not None and not 0 <= sampling.seed < 2**63:
            raise invalid_request("seed must be in [0, 2^63)", param="seed")
        params = GenerateParams(
            request_id=f"{_ID_PREFIX[api]}{uuid.uuid4().hex}",
            prompt_token_ids=tuple(prompt_ids),
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            stop=stop,
            ignore_eos=sampling.ignore_eos,
        )
        return PreparedCompletion(
            request_id=params.request_id,
            created=int(time.time()),
            model=model,
            params=params,
            stream=delivery.stream,
            include_usage=delivery.include_usage,
            user=delivery.user,
            prompt_text=prompt_text,
            api=api,
        )

    def _prompt(self, req: CompletionRequest) -> tuple[list[int], str]:
        prompt = req.prompt
        if isinstance(prompt, list) and any(not isinstance(item, int) for item in prompt):
            # A list of prompts: one per request here.
            if len(prompt) != 1:
                raise invalid_request(
                    "one prompt per request: send a string or a list of token ids", param="prompt"
                )
            prompt = prompt[0]  # type: ignore[assignment]
        if isinstance(prompt, str):
            ids, text = self._tokenizers.encode(req.model, prompt), prompt
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = [int(t) for t in prompt]  # type: ignore[arg-type]
            vocab = self._tokenizers.vocab_size(req.model)
            if any(not 0 <= t < vocab for t in ids):
                raise invalid_request(f"token ids must be in [0, {vocab})", param="prompt")
            text = self._tokenizers.decode(req.model, ids)
        else:
            raise invalid_request("prompt must be a string or a list of token ids", param="prompt")
        if not ids:
            raise invalid_request("the prompt is empty", param="prompt")
        return ids, text

    async def dispatch(
        self, prepared: PreparedCompletion, admission: Admission | None = None
    ) -> Dispatch:
        """Predicts, routes and records the request; 503 (recorded as failed) when no site can
        take it; 429 (not recorded) when `admission` refuses the predicted tokens."""
        started = time.monotonic()
        prediction = await self.predictor.predict(prepared.prompt_text)
        if prediction is not None:
            tokens = min(prediction.tokens, prepared.params.max_tokens)
            prepared = replace(
                prepared,
                params=replace(prepared.params, predicted_tokens=tokens),
                predicted_bucket=prediction.bucket,
            )
        if admission is not None:
            admission.charge(prepared.routing.total_tokens)
        decision = self._policy.route(prepared.routing, self._registry.all())
        site = decision.site
        self.metrics.routed(self._policy.name, site.name if site is not None else None)
        await self.request_log.accepted(
            NewRequest(
                request_id=prepared.request_id,
                api=prepared.api,
                model=prepared.model,
                stream=prepared.stream,
                user=prepared.user,
                prompt_tokens=len(prepared.params.prompt_token_ids),
                max_tokens=prepared.params.max_tokens,
                routing_policy=self._policy.name,
                site_id=site.site_id if site is not None else None,
                api_key_id=admission.api_key_id if admission is not None else None,
                predicted_tokens=prepared.params.predicted_tokens,
                predicted_bucket=prediction.bucket if prediction else None,
                predictor_version=prediction.version if prediction else None,
                predicted_p90_tokens=prediction.p90_tokens if prediction else None,
                routing_detail={
                    "survivors": [list(step) for step in decision.survivors],
                    "scores": dict(decision.scores),
                    "planned_answer_tokens": decision.planned_answer_tokens,
                },
            )
        )
        if site is None:
            reason = ", ".join(f"{name}: {count}" for name, count in decision.survivors)
            message = f"no site can serve model '{prepared.model}' now (sites left after {reason})"
            if admission is not None:
                admission.settle(0)  # nothing was processed
            await self.request_log.finished(
                prepared.request_id,
                Outcome(RequestStatus.FAILED, None, 0, error=message),
            )
            raise service_unavailable(message)
        if self.settings.log_prompts:  # off by default: prompts are the users' data
            log.info(
                "%s to site %s, prompt: %r", prepared.request_id, site.name, prepared.prompt_text
            )
        return Dispatch(self, prepared, site, started_at=started, admission=admission)

    def reroute(self, prepared: PreparedCompletion, tried: set[str]) -> SiteState | None:
        untried = [site for site in self._registry.all() if site.name not in tried]
        return self._policy.route(prepared.routing, untried).site

    def record_later(self, request_id: str, outcome: Outcome) -> None:
        """Writes the outcome even if the caller is being cancelled (client disconnect)."""
        self._in_background(self.request_log.finished(request_id, outcome))

    def record_offload(self, request_id: str, giver: SiteState, taker: SiteState) -> None:
        self.metrics.offloads.labels(giver.name, taker.name).inc()
        self._in_background(self.request_log.offloaded(request_id, giver.site_id, taker.site_id))

    def _in_background(self, write: Coroutine[Any, Any, None]) -> None:
        """A write the request path must not wait for; drain() awaits what is left at shutdown."""
        task = asyncio.create_task(write)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


@dataclass(slots=True)
class Dispatch:
    """One accepted request on its way through a site."""

    service: CompletionService
    prepared: PreparedCompletion
    site: SiteState
    attempts: int = 1
    completion_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: datetime | None = None
    tried: set[str] = field(default_factory=set)
    _charged: int = 0
    # Monotonic seconds when the request was dispatched (prediction included): TTFT's origin.
    started_at: float = field(default_factory=time.monotonic)
    admission: Admission | None = None

    async def events(self) -> AsyncIterator[SiteChunk]:
        """Yields the site's chunks with tokens; the last one has finish_reason set.

        The outcome is written before the iterator ends, so a client that got its answer finds
        it recorded; a client that goes away mid-stream gets its request recorded as cancelled.
        """
        log_ = self.service.request_log
        try:
            async for chunk in self._stream_with_failover():
                yield chunk
        except OpenAIError as exc:
            self._settle()
            await log_.finished(
                self.prepared.request_id,
                self._outcome(RequestStatus.FAILED, error=exc.body.message),
            )
            raise
        except BaseException:  # GeneratorExit or CancelledError: the client went away
            self._settle()
            outcome = self._outcome(RequestStatus.CANCELLED, error="client went away")
            self.service.record_later(self.prepared.request_id, outcome)
            raise
        self._settle()
        await log_.finished(
            self.prepared.request_id, self._outcome(RequestStatus.COMPLETED), self._sample()
        )

    def _settle(self) -> None:
        """Charges the caller's key what the request really took: its prompt and the tokens
        generated, also when it failed or was cancelled."""
        if self.admission is not None:
            prompt = len(self.prepared.params.prompt_token_ids)
            self.admission.settle(prompt + self.completion_tokens)

    def _sample(self) -> NewSample | None:
        """A length sample for retraining, from answers that ended on their own or at max_tokens
        (those are censored: the true length is at least what was produced)."""
        if not self.service.settings.collect_samples or self.finish_reason not in STOP_OR_LENGTH:
            return None
        prepared = self.prepared
        return NewSample(
            model=prepared.model,
            prompt=prepared.prompt_text,
            prompt_tokens=len(prepared.params.prompt_token_ids),
            completion_tokens=self.completion_tokens,
            censored=self.finish_reason == "length",
            predicted_tokens=prepared.params.predicted_tokens,
        )

    def _outcome(self, status: RequestStatus, error: str | None = None) -> Outcome:
        """The request's final outcome; called once, when it ends, so it is counted here."""
        self.service.metrics.finished(
            self.site.name,
            self.prepared.model,
            status.value,
            (len(self.prepared.params.prompt_token_ids), self.completion_tokens),
            self.prepared.params.predicted_tokens,
        )
        return Outcome(
            status=status,
            site_id=self.site.site_id,
            attempts=self.attempts,
            completion_tokens=self.completion_tokens,
            finish_reason=self.finish_reason,
            error=error,
            first_token_at=self.first_token_at,
        )

    async def _stream_with_failover(self) -> AsyncIterator[SiteChunk]:
        released_from: SiteState | None = None
        while True:
            if released_from is not None:
                self.service.record_offload(self.prepared.request_id, released_from, self.site)
                released_from = None
            self.tried.add(self.site.name)
            self.site.in_flight += 1
            self._recharge()
            try:
                async with aclosing(
                    self.site.client.generate(
                        self.prepared.params, self.service.settings.request_timeout_s
                    )
                ) as chunks:
                    async for chunk in chunks:
                        if chunk.finish_reason == "released":
                            released_from = self.site
                            break  # handed back before it started: place it elsewhere
                        self._observe(chunk)
                        self._recharge()
                        if chunk.token_ids or chunk.text or chunk.finish_reason:
                            yield chunk
                        if chunk.finish_reason is not None:
                            return
            except SiteUnavailable as exc:
                self.site.mark_unhealthy(exc.detail)
                self.service.metrics.failovers.labels(self.site.name).inc()
                log.warning("%s; moving %s elsewhere", exc, self.prepared.request_id)
            except SiteRejected as exc:
                raise invalid_request(exc.detail) from exc
            except SiteFailed as exc:
                raise upstream_failed(str(exc)) from exc
            finally:
                self.site.in_flight -= 1
                self._recharge(leaving=True)
            self._move_elsewhere()

    def _recharge(self, leaving: bool = False) -> None:
        """Keeps the site's outstanding-token ledger at prompt + predicted remaining answer."""
        routing = self.prepared.routing
        remaining = max(routing.answer_tokens - self.completion_tokens, 0)
        charge = 0 if leaving else routing.prompt_tokens + remaining
        self.site.ledger_tokens += charge - self._charged
        self._charged = charge

    def _observe(self, chunk: SiteChunk) -> None:
        if chunk.token_ids and self.first_token_at is None:
            self.first_token_at = utcnow()
            self.service.metrics.ttft_seconds.labels(self.site.name).observe(
                time.monotonic() - self.started_at
            )
        self.completion_tokens += len(chunk.token_ids)
        if chunk.finish_reason is not None:
            # The site's own count is authoritative (it includes tokens cut by a stop string).
            self.completion_tokens = chunk.completion_tokens
            self.finish_reason = chunk.finish_reason
            if chunk.finish_reason == "cancelled":
                raise upstream_failed(f"site {self.site.name} cancelled the request")

    def _move_elsewhere(self) -> None:
        if self.completion_tokens:
            # Resuming a half-finished answer on another site is the reliability issue's job.
            raise upstream_failed(f"site {self.site.name} failed mid-stream")
        next_site = self.service.reroute(self.prepared, self.tried)
        if next_site is None:
            raise service_unavailable(
                f"no other site can take request {self.prepared.request_id} "
                f"(tried: {', '.join(sorted(self.tried))})"
            )
        self.site = next_site
        self.attempts += 1
