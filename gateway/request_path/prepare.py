"""Stage 1, prepare: from a request as the client sent it to a PreparedCompletion, checking
everything that can be checked without a site (so bad input changes nothing): the prompt, its
tokens, the sampling fields against the model's context and vocabulary, and, once the caller's
key is known, the prefix-cache salt routing weighs what sites hold under.

Chat renders its template first (gateway/chat/service.py) and joins here at prepare_tokens.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import msgspec

from fedllm_contract.request_options import RequestOptions
from gateway.completions.cache_salt import cache_salt
from gateway.completions.request import CompletionRequest
from gateway.completions.sampling_options import (
    check_options,
    check_stream_options,
    options_from_wire,
)
from gateway.dispatch.request import Api, PreparedCompletion
from gateway.errors import (
    GatewayError,
    NotFound,
    context_exceeded,
    invalid_request,
    model_not_found,
)
from gateway.model_catalogue import AdapterCatalogue
from gateway.settings import GatewaySettings
from gateway.sites.interface import GenerateParams
from gateway.sites.registry import SiteRegistry
from gateway.tokenizers import ModelTokenizers

# Prompts of one /v1/completions request (a list): each is a request of its own at the sites.
MAX_PROMPTS = 64
_ID_PREFIX: dict[Api, str] = {
    "completions": "cmpl-",
    "chat.completions": "chatcmpl-",
    "responses": "resp_",  # the Responses API's ids, which its clients read back
}


@dataclass(frozen=True, slots=True)
class Sampling:
    """What every API shares beyond the prompt: the answer's length as the client asked it, and
    the request's options (checked here against the model)."""

    max_tokens: int | None = None
    # The wire name of the length limit the client used (chat has two), for error messages.
    max_tokens_param: str = "max_tokens"
    # The wire name of the prompt, for a prompt that alone does not fit (chat: "messages").
    prompt_param: str = "prompt"
    options: RequestOptions = field(default_factory=RequestOptions)
    # The wire name of the alternatives' count (completions call it logprobs).
    top_logprobs_param: str = "top_logprobs"
    # Without max_tokens: the API's default (completions) or the rest of the context (chat).
    to_context_end: bool = False


@dataclass(frozen=True, slots=True)
class Delivery:
    """How the answer goes back and whom it is for."""

    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    cache_salt: str | None = None
    # The client's own names for its conversation (see session_key).
    session_id: str | None = None
    prompt_cache_key: str | None = None


def session_key(delivery: Delivery) -> str | None:
    """The key session affinity follows (gateway/routing/affinity.py): the first given of
    `session_id` (vLLM's and llm-d's clients), `prompt_cache_key` (OpenAI's cache-routing key)
    and `user`; None without any (an empty string is none)."""
    return delivery.session_id or delivery.prompt_cache_key or delivery.user or None


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


def completion_options(req: CompletionRequest) -> RequestOptions:
    """A completion's options: its `logprobs` is the number of alternatives (0..20 here: vLLM's
    bound; OpenAI's is 5)."""
    return options_from_wire(req, logprobs=req.logprobs is not None, top_logprobs=req.logprobs)


def _embedding_model(model: str, api: Api, generative: list[str]) -> GatewayError:
    endpoint = "/v1/" + api.replace(".", "/")
    return NotFound(
        f"model '{model}' is an embedding model: it is served at /v1/embeddings, not at "
        f"{endpoint}; models for {endpoint} here: {', '.join(generative) or 'none'}",
        param="model",
        code="model_not_found",
    )


class Preparer:
    """Prepares requests for one federation's models; raises GatewayError (4xx) without touching
    any state."""

    def __init__(
        self,
        settings: GatewaySettings,
        registry: SiteRegistry,
        tokenizers: ModelTokenizers,
        shared_prefix_cache_models: frozenset[str] = frozenset(),
        embedding_models: frozenset[str] = frozenset(),
        adapters: AdapterCatalogue | None = None,
    ) -> None:
        """`shared_prefix_cache_models`: models whose sites share cached prompt blocks across
        API keys (the federation file's `share_prefix_cache`); `embedding_models`: those served
        at /v1/embeddings only (`"task": "embed"`), which no completion may name."""
        self._settings = settings
        self._registry = registry
        self._tokenizers = tokenizers
        self._shared_prefix_cache_models = shared_prefix_cache_models
        self._embedding_models = embedding_models
        self.adapters = adapters or AdapterCatalogue(registry)

    def resolve(self, model: str) -> tuple[str, str | None]:
        """The base model a request's `model` is for and the LoRA adapter (None: the base
        itself); a name that is neither comes back as it is (check_model then refuses it).
        Whose adapter it is is checked once the key is known (check_owner)."""
        if model in self._tokenizers or model in self._embedding_models:
            return model, None
        adapter = self.adapters.find(model)
        return (adapter.parent, adapter.name) if adapter is not None else (model, None)

    def check_owner(
        self, prepared: PreparedCompletion, key_id: int | None, key_name: str | None
    ) -> None:
        """404, as for an unknown model, when the request is for another key's adapter."""
        adapter = prepared.params.options.adapter
        if adapter is not None and not self.adapters.may_use(adapter, key_id, key_name):
            raise model_not_found(adapter)

    def check_model_owner(self, model: str, key_id: int | None, key_name: str | None) -> None:
        """The model resolved for the caller's key, before anything of the request is validated
        or tokenized (a batch's before its items are): a name this gateway does not serve and
        another key's adapter or `ft:` model both get the 404 of an unknown model at once,
        whatever else the request holds, as fast. (Checking only the adapter first let an
        unknown name fail on the request's other checks, a 400, while another key's adapter got
        the 404: the answers told the two apart; issue 67.)"""
        base, adapter = self.resolve(model)
        if adapter is None:
            if base not in self._tokenizers and base not in self._embedding_models:
                raise model_not_found(model)
        elif not self.adapters.may_use(adapter, key_id, key_name):
            raise model_not_found(model)

    def servable_now(self, model: str) -> bool:
        """Whether a healthy site serves `model` now (for an adapter: lists it)."""
        base, adapter = self.resolve(model)
        return any(
            site.healthy and site.model == base and (adapter is None or adapter in site.adapters)
            for site in self._registry.all()
        )

    def check_model(self, model: str, api: Api) -> None:
        """404 unless `model` is a generative model this gateway serves; for an embedding
        model, one that says where it is served."""
        if model in self._embedding_models:
            raise _embedding_model(model, api, self._generative_models())
        if model not in self._tokenizers:
            raise model_not_found(model)

    def _generative_models(self) -> list[str]:
        return [m for m in self._tokenizers.models() if m not in self._embedding_models]

    def prepare(self, req: CompletionRequest) -> PreparedCompletion:
        """A /v1/completions request: validated and tokenized."""
        model, adapter = self.resolve(req.model)
        self.check_model(model, "completions")
        req = msgspec.structs.replace(req, model=model)
        _reject_unsupported(req)
        prompt_ids, prompt_text = self._prompt(req)
        sampling = Sampling(
            max_tokens=req.max_tokens,
            options=completion_options(req),
            top_logprobs_param="logprobs",
        )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        delivery = Delivery(
            stream=req.stream,
            include_usage=include_usage,
            user=req.user,
            cache_salt=req.cache_salt,
            session_id=req.session_id,
            prompt_cache_key=req.prompt_cache_key,
        )
        prepared = self.prepare_tokens(
            req.model, prompt_ids, prompt_text, sampling, delivery, adapter=adapter
        )
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
        adapter: str | None = None,
    ) -> PreparedCompletion:
        """Validates the sampling fields against an already tokenized prompt (what every API
        shares). `prompt_text` is what the length predictor reads; `adapter`: the LoRA adapter
        of `model` the request is for (Preparer.resolve), which rides in its options."""
        self.check_model(model, api)
        max_tokens = self._max_tokens(model, len(prompt_ids), sampling)
        options = check_options(
            replace(sampling.options, adapter=adapter),
            self._tokenizers.vocab_size(model),
            self._settings.limits.max_choices,
            sampling.top_logprobs_param,
        )
        params = GenerateParams(
            # 128 random bits as uuid4().hex spells them, without building a UUID per request.
            request_id=f"{_ID_PREFIX[api]}{os.urandom(16).hex()}",
            prompt_token_ids=tuple(prompt_ids),
            max_tokens=max_tokens,
            options=options,
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
            unpredicted=self._settings.routing.plan_without_prediction,
            client_cache_salt=delivery.cache_salt,
            session_key=session_key(delivery),
            open_ended=sampling.max_tokens is None and sampling.to_context_end,
        )

    def _max_tokens(self, model: str, prompt_tokens: int, sampling: Sampling) -> int:
        """The answer's length limit: the client's, else the API's default; 400 when it does not
        fit the model's context with the prompt."""
        param = sampling.max_tokens_param
        context = self._registry.max_model_len(model)
        max_tokens = self._settings.limits.default_max_tokens
        if sampling.max_tokens is not None:
            max_tokens = sampling.max_tokens
        elif sampling.to_context_end and context is not None:
            # OpenAI's chat default: the answer runs to its end or the context's.
            max_tokens = max(context - prompt_tokens, 1)
        if max_tokens < 1:
            raise invalid_request(f"{param} must be at least 1", param=param)
        if context is not None and prompt_tokens >= context:
            # The prompt leaves no room for one token whatever the limit: the prompt's fault,
            # as OpenAI tells it ("messages" for chat).
            raise context_exceeded(
                f"This model's maximum context length is {context} tokens. However, your "
                f"{sampling.prompt_param} resulted in {prompt_tokens} tokens. Please reduce "
                f"the length of the {sampling.prompt_param}.",
                sampling.prompt_param,
            )
        if context is not None and prompt_tokens + max_tokens > context:
            raise context_exceeded(
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                f"prompt, {max_tokens} for the completion).",
                param,
            )
        return max_tokens

    def salted(self, prepared: PreparedCompletion, api_key_id: int | None) -> PreparedCompletion:
        """The request scoped to its API key before routing: the prefix-cache salt of its key
        (gateway/completions/cache_salt.py; routing weighs what a site holds under that salt),
        and its session key prefixed with the key's id, so that two tenants who pick the same
        session id do not steer each other's requests."""
        salt = cache_salt(
            api_key_id,
            prepared.client_cache_salt,
            prepared.model in self._shared_prefix_cache_models,
        )
        session = prepared.session_key
        if session is not None and api_key_id is not None:
            session = f"{api_key_id}:{session}"
        return replace(
            prepared, params=replace(prepared.params, cache_salt=salt), session_key=session
        )

    def check_prompt_chars(self, model: str, text: str, param: str) -> None:
        """400 for a prompt that cannot fit the model's context whatever its tokens, before it
        is tokenized (tokenizing runs on the event loop: ~1 s per MiB held every stream)."""
        context = self._registry.max_model_len(model)
        most = (
            None if context is None else context * self._settings.limits.max_prompt_chars_per_token
        )
        if most is not None and len(text) > most:
            raise context_exceeded(
                f"This model's maximum context length is {context} tokens; a prompt of "
                f"{len(text)} characters cannot fit (at most {most} are read).",
                param,
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
