"""An accepted request as dispatch carries it: validated, tokenized and (once predicted) planned,
with the caller's hold on its key's limits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from gateway.routing.types import RoutingRequest, UnpredictedPlan
from gateway.sites.interface import GenerateParams

Api = Literal["completions", "chat.completions", "responses"]


class AdmissionPart(Protocol):
    """What one dispatch holds of its caller's admission: the whole of it, or one prompt's share
    of a prompt list's (gateway/request_path/admit.py: one admission for the whole request)."""

    @property
    def api_key_id(self) -> int | None: ...

    def settle(self, tokens: int) -> None: ...

    def watch_revocation(self, stop: Callable[[], None]) -> None: ...


class Admission(AdmissionPart, Protocol):
    """A caller's hold on its API key's limits (gateway/tenancy/admission.py): charged once the
    answer length is predicted, settled with the tokens the request really took."""

    @property
    def api_key_name(self) -> str | None:
        """The key's name (an adapter private to a key names it: gateway/federation_adapters.py)."""
        ...

    async def charge(self, tokens: int, most_tokens: int) -> None: ...


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
    # The client's own cache_salt; params.cache_salt, once salted for its key, mixes it in.
    client_cache_salt: str | None = None
    # /v1/completions with echo: the prompt text, put before each choice's answer.
    echo: str | None = None
    # The client set no length limit (chat or Responses without max_tokens): its answer runs to
    # the context's end or its time (GATEWAY_OPEN_ANSWER_TIMEOUT_S), whichever comes first.
    open_ended: bool = False
    # Chat with tools: how the model writes tool calls (its answer is parsed into tool_calls).
    tool_calls: ToolCallParsing | None = None
    # Whose conversation this is (gateway/request_path/prepare.py: session_key), for affinity.
    session_key: str | None = None
    # The base model's predicted answer length (within max_tokens) before a LoRA adapter's
    # correction (gateway/prediction/adapter_lengths.py learns the correction against it).
    base_predicted_tokens: int | None = None

    @property
    def served_model(self) -> str:
        """The model the client named, as answers say it: the LoRA adapter when it is for one
        (`model` is then its base, which tokenizes and routes it)."""
        return self.params.options.adapter or self.model

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
            prompt_token_ids=params.prompt_token_ids,
            cache_salt=params.cache_salt,
            session_key=self.session_key,
            n=params.options.n,
            adapter=params.options.adapter,
        )

    def with_options(self, **changes: Any) -> PreparedCompletion:
        """This request with some of its options changed (a batch item's priority)."""
        options = replace(self.params.options, **changes)
        return replace(self, params=replace(self.params, options=options))


@dataclass(frozen=True, slots=True)
class ToolCallParsing:
    """What it takes to find tool calls in an answer: the model's tags around each call, and
    the functions the request offered (a call naming another is left as text)."""

    begin: str
    end: str
    names: frozenset[str]
    # tool_choice required or named: the answer is nothing but calls (constrained at the site),
    # so nothing of it is content.
    forced: bool = False
    # The request used the legacy `functions`: the answer is `message.function_call` (the
    # first call) with finish_reason "function_call", as OpenAI answers such callers.
    legacy_functions: bool = False
    # The function every call of a forced answer calls, when it is known before the model
    # writes it (a named tool_choice, or `required` with a single tool): its calls begin, and
    # stream, from their opening tag.
    named: str | None = None
