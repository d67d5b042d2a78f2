"""From a validated completion request to a finished, recorded completion.

prepare() checks everything that can be checked without a site (so bad input changes nothing);
dispatch() routes and records the request and hands it to a Dispatch (gateway/dispatch.py),
which streams it from the chosen site and records the outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import weakref
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from sqlalchemy.exc import SQLAlchemyError

from gateway.api.errors import (
    invalid_request,
    model_not_found,
    service_unavailable,
)
from gateway.api.schemas import CompletionRequest
from gateway.db.models import RequestStatus
from gateway.dispatch import Dispatch
from gateway.metrics import GatewayMetrics
from gateway.model_predictors import ModelPredictors
from gateway.overload import InFlightBound
from gateway.prediction import Prediction, PredictorService
from gateway.routing.policy import Decision, RoutingPolicy
from gateway.routing.types import RoutingRequest, UnpredictedPlan
from gateway.services.request_log import NewRequest, NewSample, Outcome, RequestLog
from gateway.settings import GatewaySettings
from gateway.sites.client import GenerateParams
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.tokenizers import ModelTokenizers

log = logging.getLogger(__name__)
# Outcome writes that failed on the request path: retried this many times, backing off from 0.5 s
# to 10 s (about a minute in all), which rides out a database failover or restart.
_RECORD_RETRIES = 8
_RECORD_RETRY_FIRST_S = 0.5
MAX_STOP_SEQUENCES = 4
# Stop strings are matched after every token; the site refuses longer ones (MAX_STOP_CHARS there).
MAX_STOP_CHARS = 1024
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

    def charge(self, tokens: int, most_tokens: int) -> None: ...

    def settle(self, tokens: int) -> None: ...

    def watch_revocation(self, stop: Callable[[], None]) -> None: ...


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
    unpredicted: UnpredictedPlan = "max_tokens"

    @property
    def routing(self) -> RoutingRequest:
        return self.routing_for(self.params)

    def routing_for(self, params: GenerateParams) -> RoutingRequest:
        """What routing weighs for these params (a continuation's prompt holds the answer so
        far, its max_tokens what is left)."""
        return RoutingRequest(
            model=self.model,
            prompt_tokens=len(params.prompt_token_ids),
            max_tokens=params.max_tokens,
            predicted_tokens=params.predicted_tokens,
            predicted_bucket=self.predicted_bucket,
            unpredicted=self.unpredicted,
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
        predictors: ModelPredictors | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.predictors = predictors or ModelPredictors(PredictorService(None))
        self.metrics = metrics or GatewayMetrics()
        self._registry = registry
        self._tokenizers = tokenizers
        self._policy = policy
        self.request_log = request_log
        self._background: set[asyncio.Task[None]] = set()
        self.bound = InFlightBound(settings.max_in_flight)

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
            unpredicted=self.settings.plan_without_prediction,
        )

    def check_prompt_chars(self, model: str, text: str, param: str) -> None:
        """400 for a prompt that cannot fit the model's context whatever its tokens, before it
        is tokenized (tokenizing runs on the event loop: ~1 s per MiB held every stream)."""
        context = self._registry.max_model_len(model)
        most = None if context is None else context * self.settings.max_prompt_chars_per_token
        if most is not None and len(text) > most:
            raise invalid_request(
                f"This model's maximum context length is {context} tokens; a prompt of "
                f"{len(text)} characters cannot fit (at most {most} are read).",
                param=param,
                code="context_length_exceeded",
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
            self.check_prompt_chars(req.model, prompt, "prompt")
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
        take it; 429 (not recorded) when `admission` refuses the predicted tokens or the
        gateway already holds its limit of requests (GATEWAY_MAX_IN_FLIGHT)."""
        self.bound.enter()
        try:
            dispatch = await self._dispatch(prepared, admission)
        except BaseException:
            self.bound.leave()
            raise
        # The slot is given back when the request ends, or when its Dispatch is dropped unused
        # (a stream the server never started because the client had gone).
        dispatch.slot = weakref.finalize(dispatch, self.bound.leave)
        return dispatch

    async def _dispatch(
        self, prepared: PreparedCompletion, admission: Admission | None
    ) -> Dispatch:
        started = time.monotonic()
        prediction = await self.predictors.predict(prepared.model, prepared.prompt_text)
        if prediction is not None:
            tokens = min(prediction.tokens, prepared.params.max_tokens)
            prepared = replace(
                prepared,
                params=replace(prepared.params, predicted_tokens=tokens),
                predicted_bucket=prediction.bucket,
            )
        if admission is not None:
            routing = prepared.routing
            most = routing.prompt_tokens + routing.max_tokens
            # ignore_eos answers run to max_tokens whatever was predicted: charged as such.
            admission.charge(most if prepared.params.ignore_eos else routing.total_tokens, most)
        decision = self._policy.route(prepared.routing, self._registry.all())
        site = decision.site
        self.metrics.routed(self._policy.name, site.name if site is not None else None)
        # Built (and counted on its site) before the first await: the next request of a burst
        # is routed while this one is being recorded, and must see it.
        dispatch = (
            Dispatch(self, prepared, site, started_at=started, admission=admission)
            if site is not None
            else None
        )
        try:
            await self._record_accepted(prepared, decision, prediction, admission)
        except BaseException:
            if dispatch is not None:
                dispatch.abandon()
            raise
        if dispatch is None:
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
                "%s to site %s, prompt: %r",
                prepared.request_id,
                dispatch.site.name,
                prepared.prompt_text,
            )
        return dispatch

    async def _record_accepted(
        self,
        prepared: PreparedCompletion,
        decision: Decision[SiteState],
        prediction: Prediction | None,
        admission: Admission | None,
    ) -> None:
        site = decision.site
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

    def reroute(
        self,
        prepared: PreparedCompletion,
        excluded: set[str],
        routing: RoutingRequest | None = None,
    ) -> SiteState | None:
        """Another site for the request, not one of `excluded` (`routing`: a continuation's
        prompt and answer left)."""
        others = [site for site in self._registry.all() if site.name not in excluded]
        return self._policy.route(routing or prepared.routing, others).site

    def decode_answer(self, model: str, token_ids: list[int]) -> str:
        return self._tokenizers.decode_answer(model, token_ids)

    def record_later(self, request_id: str, outcome: Outcome) -> None:
        """Writes the outcome even if the caller is being cancelled (client disconnect)."""
        self._in_background(self._record_with_retries(request_id, outcome, None))

    async def record_finished(
        self, request_id: str, outcome: Outcome, sample: NewSample | None = None
    ) -> None:
        """Writes the outcome of a request whose answer is already produced. A database that
        is briefly unreachable must not turn a finished answer into an error: the write is
        retried in the background instead, and the caller gets its answer."""
        try:
            await self.request_log.finished(request_id, outcome, sample)
        except (SQLAlchemyError, OSError) as exc:
            log.warning(
                "recording the outcome of %s failed (%s); retrying in the background",
                request_id,
                type(exc).__name__,
            )
            self._in_background(self._record_with_retries(request_id, outcome, sample))

    async def _record_with_retries(
        self, request_id: str, outcome: Outcome, sample: NewSample | None
    ) -> None:
        delay = _RECORD_RETRY_FIRST_S
        for attempt in range(_RECORD_RETRIES):
            try:
                await self.request_log.finished(request_id, outcome, sample)
                return
            except (SQLAlchemyError, OSError) as exc:
                if attempt == _RECORD_RETRIES - 1:
                    log.error(
                        "giving up recording the outcome of %s: %s", request_id, type(exc).__name__
                    )
                    return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

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
