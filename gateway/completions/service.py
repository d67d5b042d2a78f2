"""From a validated completion request to a finished, recorded completion.

prepare() checks everything that can be checked without a site (so bad input changes nothing);
dispatch() routes and records the request and hands it to a Dispatch (gateway/dispatch/stream.py),
which streams it from the chosen site and records the outcome.
"""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import msgspec

from gateway.completions.cache_salt import cache_salt
from gateway.completions.overload import InFlightBound
from gateway.completions.request import CompletionRequest
from gateway.completions.sampling_options import (
    RequestedOptions,
    check_options,
    check_stream_options,
)
from gateway.db.models import RequestStatus
from gateway.dispatch.accounting import DispatchLimits, OutcomeRecorder
from gateway.dispatch.request import Admission as Admission
from gateway.dispatch.request import Api
from gateway.dispatch.request import PreparedCompletion as PreparedCompletion
from gateway.dispatch.stream import Dispatch
from gateway.errors import (
    invalid_request,
    model_not_found,
    service_unavailable,
)
from gateway.metrics import GatewayMetrics
from gateway.prediction.by_model import ModelPredictors
from gateway.prediction.service import Prediction, PredictorService
from gateway.routing.policy import Decision, RoutingPolicy
from gateway.routing.types import RoutingRequest
from gateway.settings import GatewaySettings
from gateway.sites.interface import GenerateParams
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.stores.request_log import NewRequest, Outcome, RequestLog
from gateway.stores.request_writer import RequestLogWriter
from gateway.tokenizers import ModelTokenizers

log = logging.getLogger(__name__)
# Outcome writes that failed on the request path: retried this many times, backing off from 0.5 s
# to 10 s (about a minute in all), which rides out a database failover or restart.
MAX_STOP_SEQUENCES = 4
# Stop strings are matched after every token; the site refuses longer ones (MAX_STOP_CHARS there).
MAX_STOP_CHARS = 1024
# Prompts of one /v1/completions request (a list): each is a request of its own at the sites.
MAX_PROMPTS = 64
_ID_PREFIX: dict[Api, str] = {"completions": "cmpl-", "chat.completions": "chatcmpl-"}
# The request parameter behind each site capability, for the 400 of a request no site can do.
_CAPABILITY_PARAM = {
    "penalties": "presence_penalty",
    "json_schema": "response_format",
    "json_object": "response_format",
    "tagged_json": "tool_choice",
}


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
    # n, penalties, logit_bias, logprobs and the decoding constraint, as the client sent them.
    options: RequestedOptions = field(default_factory=RequestedOptions)
    # Without max_tokens: the API's default (completions) or the rest of the context (chat).
    to_context_end: bool = False


@dataclass(frozen=True, slots=True)
class Delivery:
    """How the answer goes back and whom it is for."""

    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    cache_salt: str | None = None


def _reject_unsupported(req: CompletionRequest) -> None:
    unsupported = {
        "best_of": req.best_of not in (None, 1, req.n),
        "suffix": req.suffix is not None,
        # Prompt logprobs (echo with logprobs) are not computed by the sites.
        "echo": req.echo and req.logprobs is not None,
    }
    for param, used in unsupported.items():
        if used:
            raise invalid_request(f"'{param}' is not supported by this gateway", param=param)
    check_stream_options(req.stream, req.stream_options)


def completion_options(req: CompletionRequest) -> RequestedOptions:
    """A completion's options: its `logprobs` is the number of alternatives (0..20 here: vLLM's
    bound; OpenAI's is 5)."""
    return RequestedOptions(
        n=req.n,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=req.logit_bias,
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs,
        top_logprobs_param="logprobs",
    )


def accepted_request(
    prepared: PreparedCompletion,
    *,
    routing_policy: str,
    site: SiteState | None,
    routing_detail: dict[str, object],
    api: str | None = None,
    api_key_id: int | None = None,
    predictor_version: str | None = None,
    predicted_p90_tokens: int | None = None,
) -> NewRequest:
    """The request log's row for a request accepted on `site` (None: no site could take it),
    for every API that dispatches completions (a batch item passes api="batch")."""
    params = prepared.params
    return NewRequest(
        request_id=prepared.request_id,
        api=api or prepared.api,
        model=prepared.model,
        stream=prepared.stream,
        user=prepared.user,
        prompt_tokens=len(params.prompt_token_ids),
        max_tokens=params.max_tokens,
        routing_policy=routing_policy,
        site_id=site.site_id if site is not None else None,
        api_key_id=api_key_id,
        predicted_tokens=params.predicted_tokens,
        predicted_bucket=prepared.predicted_bucket,
        predictor_version=predictor_version,
        predicted_p90_tokens=predicted_p90_tokens,
        routing_detail=routing_detail,
    )


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
        shared_prefix_cache_models: frozenset[str] = frozenset(),
    ) -> None:
        """`shared_prefix_cache_models`: models whose sites share cached prompt blocks across
        API keys (the federation file's `share_prefix_cache`)."""
        self.settings = settings
        self._shared_prefix_cache_models = shared_prefix_cache_models
        self.predictors = predictors or ModelPredictors(PredictorService(None))
        self.metrics = metrics or GatewayMetrics()
        self._registry = registry
        self._tokenizers = tokenizers
        self._policy = policy
        # Batch items write their row before they run (gateway/batches/item_runner.py); client
        # requests are written behind, in batches, by the writer.
        self.request_log = request_log
        self.writer = RequestLogWriter(
            request_log,
            settings.limits.outcome_backlog_max,
            flush_s=settings.database.request_log_flush_ms / 1000,
        )
        self.recorder = OutcomeRecorder(self.writer, self.metrics)
        self.metrics.watch_backlog(
            "outcome_backlog",
            "Requests whose rows or outcomes the database has not taken yet (written in batches "
            "every few ms, and kept while the database refuses them; usage per key is summed "
            "from them)",
            self.writer.__len__,
        )
        self.metrics.watch_backlog(
            "outcome_backlog_oldest_seconds",
            "How long the oldest write not taken yet has waited",
            self.writer.oldest_s,
        )
        self.limits = DispatchLimits(
            request_timeout_s=settings.limits.request_timeout_s,
            max_continuations=settings.limits.max_continuations,
            collect_samples=settings.predictor.collect_samples,
        )
        self.bound = InFlightBound(settings.limits.max_in_flight)

    def prepare(self, req: CompletionRequest) -> PreparedCompletion:
        """Validates and tokenizes; raises GatewayError (4xx) without touching any state."""
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
            options=completion_options(req),
        )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        delivery = Delivery(
            stream=req.stream, include_usage=include_usage, user=req.user, cache_salt=req.cache_salt
        )
        prepared = self.prepare_tokens(req.model, prompt_ids, prompt_text, sampling, delivery)
        return replace(prepared, echo=prompt_text if req.echo else None)

    def prepare_prompts(self, req: CompletionRequest) -> list[PreparedCompletion]:
        """A request with a list of prompts as one prepared request per prompt (OpenAI answers
        them as one completion whose choices run prompt by prompt); a single prompt as one."""
        prompt = req.prompt
        several = isinstance(prompt, list) and len(prompt) > 1
        if not several or any(isinstance(item, int) for item in prompt):
            return [self.prepare(req)]
        if len(prompt) > MAX_PROMPTS:
            raise invalid_request(f"a request takes at most {MAX_PROMPTS} prompts", param="prompt")
        return [self.prepare(msgspec.structs.replace(req, prompt=[one])) for one in prompt]

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
        shares); raises GatewayError (4xx) without touching any state. `prompt_text` is what the
        length predictor reads."""
        if model not in self._tokenizers:
            raise model_not_found(model)
        param = sampling.max_tokens_param
        context = self._registry.max_model_len(model)
        max_tokens = self.settings.limits.default_max_tokens
        if sampling.max_tokens is not None:
            max_tokens = sampling.max_tokens
        elif sampling.to_context_end and context is not None:
            # OpenAI's chat default: the answer runs to its end or the context's.
            max_tokens = max(context - len(prompt_ids), 1)
        if max_tokens < 1:
            raise invalid_request(f"{param} must be at least 1", param=param)
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
        options = check_options(
            sampling.options, self._tokenizers.vocab_size(model), self.settings.limits.max_choices
        )
        params = GenerateParams(
            request_id=f"{_ID_PREFIX[api]}{uuid.uuid4().hex}",
            prompt_token_ids=tuple(prompt_ids),
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            stop=stop,
            ignore_eos=sampling.ignore_eos,
            presence_penalty=options.presence_penalty,
            frequency_penalty=options.frequency_penalty,
            logit_bias=options.logit_bias,
            logprobs=options.logprobs,
            top_logprobs=options.top_logprobs,
            constraint=options.constraint,
            n=options.n,
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
            unpredicted=self.settings.routing.plan_without_prediction,
            client_cache_salt=delivery.cache_salt,
        )

    def salted(self, prepared: PreparedCompletion, api_key_id: int | None) -> PreparedCompletion:
        """The request with the prefix-cache salt of its key (gateway/completions/cache_salt.py);
        set before routing, which may weigh what a site holds under that salt."""
        salt = cache_salt(
            api_key_id,
            prepared.client_cache_salt,
            prepared.model in self._shared_prefix_cache_models,
        )
        return replace(prepared, params=replace(prepared.params, cache_salt=salt))

    def check_prompt_chars(self, model: str, text: str, param: str) -> None:
        """400 for a prompt that cannot fit the model's context whatever its tokens, before it
        is tokenized (tokenizing runs on the event loop: ~1 s per MiB held every stream)."""
        context = self._registry.max_model_len(model)
        most = (
            None if context is None else context * self.settings.limits.max_prompt_chars_per_token
        )
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
        gateway already holds its limit of requests (GATEWAY_MAX_IN_FLIGHT); 503 while the
        writes the database has not taken fill their queue (accepted work is never lost)."""
        if self.writer.full:
            raise service_unavailable(
                "the gateway's request log is behind (the database is not taking writes); "
                "retry shortly"
            )
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
        prepared = self.salted(prepared, admission.api_key_id if admission is not None else None)
        # The one request in flight may have its prompt predicted on the loop: nobody waits.
        alone = self.bound.in_flight == 1
        prediction = await self.predictors.predict(
            prepared.model, prepared.prompt_text, alone=alone
        )
        if prediction is not None:
            tokens = prediction.within(prepared.params.max_tokens)
            prepared = replace(
                prepared,
                params=replace(prepared.params, predicted_tokens=tokens),
                predicted_bucket=prediction.bucket,
            )
        if admission is not None:
            routing = prepared.routing
            most = routing.prompt_tokens + routing.max_tokens * routing.n
            # ignore_eos answers run to max_tokens whatever was predicted: charged as such.
            charged = most if prepared.params.ignore_eos else routing.total_tokens
            await admission.charge(charged, most)
        decision = self._policy.route(prepared.routing, self._able_sites(prepared))
        site = decision.site
        self.metrics.routed(self._policy.name, site.name if site is not None else None)
        # Built (and counted on its site) before the next await: the next request of a burst
        # must see it.
        dispatch = (
            self.open_dispatch(prepared, site, started_at=started, admission=admission)
            if site is not None
            else None
        )
        self._record_accepted(prepared, decision, prediction, admission)
        if dispatch is None:
            reason = ", ".join(f"{name}: {count}" for name, count in decision.survivors)
            message = f"no site can serve model '{prepared.model}' now (sites left after {reason})"
            if admission is not None:
                admission.settle(0)  # nothing was processed
            self.writer.finished(
                prepared.request_id, Outcome(RequestStatus.FAILED, None, 0, error=message)
            )
            raise service_unavailable(message)
        if self.settings.server.log_prompts:  # off by default: prompts are the users' data
            log.info(
                "%s to site %s, prompt: %r",
                prepared.request_id,
                dispatch.site.name,
                prepared.prompt_text,
            )
        return dispatch

    def _able_sites(self, prepared: PreparedCompletion) -> list[SiteState]:
        """The sites that can do what the request needs (n, logprobs, a constraint...); 400
        naming what, and which sites of the model cannot, when none of them can: the gateway
        refuses only what the sites it would choose from cannot do."""
        sites = self._registry.all()
        needs = prepared.params.needs()
        if not needs:
            return sites
        able = [site for site in sites if needs <= site.client.capabilities]
        serving = [site for site in sites if site.model == prepared.model]
        if serving and not any(site.model == prepared.model for site in able):
            missing = sorted(needs - frozenset.intersection(
                *(site.client.capabilities for site in serving)))  # fmt: skip
            names = ", ".join(site.name for site in serving)
            raise invalid_request(
                f"no site serving model '{prepared.model}' ({names}) can do what this request "
                f"asks: {', '.join(missing)}",
                param=_CAPABILITY_PARAM.get(missing[0], missing[0]),
            )
        return able

    def _record_accepted(
        self,
        prepared: PreparedCompletion,
        decision: Decision[SiteState],
        prediction: Prediction | None,
        admission: Admission | None,
    ) -> None:
        site = decision.site
        self.writer.accepted(
            accepted_request(
                prepared,
                routing_policy=self._policy.name,
                site=site,
                api_key_id=admission.api_key_id if admission is not None else None,
                predictor_version=prediction.version if prediction else None,
                predicted_p90_tokens=prediction.p90_tokens if prediction else None,
                routing_detail={
                    "survivors": [list(step) for step in decision.survivors],
                    "scores": dict(decision.scores),
                    "planned_answer_tokens": decision.planned_answer_tokens,
                },
            )
        )

    @property
    def policy(self) -> RoutingPolicy:
        """The routing profile requests are placed by (the batch API assigns by its cost)."""
        return self._policy

    def reroute(
        self,
        prepared: PreparedCompletion,
        excluded: set[str],
        routing: RoutingRequest | None = None,
    ) -> SiteState | None:
        """Another site for the request, not one of `excluded` (`routing`: a continuation's
        prompt and answer left)."""
        others = [site for site in self._able_sites(prepared) if site.name not in excluded]
        return self._policy.route(routing or prepared.routing, others).site

    def decode_answer(self, model: str, token_ids: Sequence[int]) -> str:
        return self._tokenizers.decode_answer(model, list(token_ids))

    def open_dispatch(
        self,
        prepared: PreparedCompletion,
        site: SiteState,
        started_at: float | None = None,
        admission: Admission | None = None,
    ) -> Dispatch:
        """A Dispatch of the prepared request on `site`, counted there at once."""
        return Dispatch(
            prepared,
            site,
            placement=self,
            recorder=self.recorder,
            limits=self.limits,
            metrics=self.metrics,
            started_at=time.monotonic() if started_at is None else started_at,
            admission=admission,
        )

    async def drain(self) -> None:
        await self.recorder.drain()
        await self.request_log.close()
