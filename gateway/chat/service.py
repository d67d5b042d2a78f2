"""From a chat request to a prepared completion: validate, render the model's chat template,
tokenize, then share every later step (sampling checks, routing, dispatch) with
/v1/completions through the request path (gateway/request_path/)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

import msgspec

from fedllm_contract.grammar import ConstraintSpec
from fedllm_contract.request_options import Priority
from gateway.chat.legacy_functions import legacy_error, tool_fields
from gateway.chat.request import ChatCompletionRequest
from gateway.chat.response_format import checked, response_constraint
from gateway.chat.templates import (
    ChatRenderError,
    ChatTemplates,
    NoChatTemplate,
    RenderedChat,
    render_messages_as_text,
)
from gateway.chat.tools import ToolRequest, check_tools, tool_constraint, tools_prompt
from gateway.chat.turns import TemplateAbilities, Turn, conversation
from gateway.completions.sampling_options import (
    TIER_PRIORITY,
    check_stream_options,
    options_from_wire,
)
from gateway.dispatch.request import Api, PreparedCompletion, ToolCallParsing
from gateway.errors import (
    GatewayError,
    Unserved,
    invalid_request,
    model_not_found,
    refuse_unserved,
)
from gateway.federation import ToolCallFormat
from gateway.request_path.prepare import Delivery, Sampling
from gateway.request_path.service import CompletionService
from gateway.tokenizers import ModelTokenizers

# Fields that ask for a capability no model of this gateway has: param -> (is the value one
# this gateway serves, why not). OpenAI refuses them alike for a model without it.
_NOT_OFFERED: Unserved = {
    "modalities": (
        lambda v: v is None or set(v) <= {"text"},
        "the models here are text-only: modalities must be ['text']",
    ),
    "audio": (lambda v: v is None, "the models here are text-only: no audio output"),
    "web_search_options": (lambda v: v is None, "no model here searches the web"),
    "moderation": (lambda v: v is None, "this gateway runs no moderation model"),
}


def reject_unsupported(req: ChatCompletionRequest) -> None:
    refuse_unserved(req, _NOT_OFFERED)
    check_stream_options(req.stream, req.stream_options)


def _tools(req: ChatCompletionRequest) -> tuple[ToolRequest | None, bool]:
    """The request's tools, checked (its legacy functions as tools), and whether it is a legacy
    caller."""
    fields = tool_fields(req)
    try:
        return check_tools(fields.tools, fields.tool_choice, fields.parallel), fields.legacy
    except GatewayError as exc:
        raise (legacy_error(exc) if fields.legacy else exc) from exc


def _predictor_text(turns: list[Turn]) -> str:
    # The length predictor was trained on single prompts: an answer's length follows the
    # question it answers, the last user message, not the template's markup.
    users = [turn["content"] for turn in turns if turn["role"] == "user"]
    return users[-1] if users else "\n".join(turn["content"] for turn in turns)


def _sampling(req: ChatCompletionRequest, constraint: ConstraintSpec | None) -> Sampling:
    limits = {"max_tokens": req.max_tokens, "max_completion_tokens": req.max_completion_tokens}
    given = {name: value for name, value in limits.items() if value is not None}
    if len(set(given.values())) > 1:
        raise invalid_request(
            "max_tokens and max_completion_tokens disagree: send one of them "
            "(max_completion_tokens is the current name)",
            param="max_completion_tokens",
        )
    param = "max_completion_tokens" if "max_completion_tokens" in given else "max_tokens"
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid_request("top_logprobs needs logprobs: true", param="logprobs")
    options = options_from_wire(
        req,
        logprobs=bool(req.logprobs),
        constraint=constraint,
        priority=TIER_PRIORITY.get(req.service_tier or "auto", Priority.INTERACTIVE),
    )
    return Sampling(
        max_tokens=given.get(param),
        max_tokens_param=param,
        prompt_param="messages",
        options=options,
        to_context_end=True,
    )


class ChatService:
    def __init__(
        self,
        templates: ChatTemplates,
        tokenizers: ModelTokenizers,
        completions: CompletionService,
        tool_formats: Mapping[str, ToolCallFormat] | None = None,
        parse_special_tokens: Collection[str] = (),
    ) -> None:
        self._tool_formats = dict(tool_formats or {})
        self._templates = templates
        self._tokenizers = tokenizers
        self._completions = completions
        # Models whose messages may carry control tokens (the federation file's
        # parse_special_tokens_in_messages); the others' message content is text.
        self._parse_special_tokens = frozenset(parse_special_tokens)

    def _render(
        self, model: str, turns: list[Turn], tools: Sequence[Mapping[str, Any]] | None
    ) -> RenderedChat:
        template = self._templates[model]
        if model in self._parse_special_tokens:
            text = template.render(turns, add_generation_prompt=True, tools=tools)
            return RenderedChat(text, ((text, False),))
        specials = self._tokenizers.special_tokens(model)
        return render_messages_as_text(
            template, turns, specials, add_generation_prompt=True, tools=tools
        )

    def prepare(
        self, req: ChatCompletionRequest, api: Api = "chat.completions"
    ) -> PreparedCompletion:
        """Validates, renders and tokenizes; raises GatewayError (4xx) without touching any
        state. Dispatch is then CompletionService.dispatch, as for /v1/completions. `api`: the
        API the request came through (the Responses API prepares its requests here too)."""
        model, adapter = self._completions.preparer.resolve(req.model)
        self._completions.preparer.check_model(model, api)
        req = msgspec.structs.replace(req, model=model)
        if req.model not in self._templates:
            raise model_not_found(req.model)
        reject_unsupported(req)
        tools, legacy = _tools(req)
        fmt = self._tool_formats.get(req.model, ToolCallFormat())
        constraint = response_constraint(req.response_format)
        calls = tool_constraint(tools, fmt) if tools is not None else None
        if calls is not None:
            # Checked whole, as the site will compile it: each tool's parameters passing alone
            # does not make their calls' grammar one the site can enforce (its size, say).
            constraint = checked(calls, "tools", "the tool calls these tools ask for")
        sampling = _sampling(req, constraint)
        try:
            template = self._templates[req.model]
            abilities = TemplateAbilities(template.knows("tools"), template.knows("developer"))
            shown = tools_prompt(tools, fmt) if tools and not abilities.tools else None
            turns = conversation(req.messages, abilities, fmt, shown)
            listed = list(tools.tools) if tools and abilities.tools else None
            rendered = self._render(req.model, turns, listed)
        except ChatRenderError as exc:
            raise invalid_request(
                f"the chat template of model '{req.model}' refused these messages: {exc}",
                param="messages",
            ) from exc
        except NoChatTemplate as exc:
            raise invalid_request(
                f"model '{req.model}' has no chat template (its tokenizer carries none and the "
                "federation file names none): send a prompt to /v1/completions instead",
                param="model",
            ) from exc
        self._completions.preparer.check_prompt_chars(req.model, rendered.text, "messages")
        prompt_ids = self._tokenizers.encode_pieces(req.model, rendered.pieces)
        if not prompt_ids:
            raise invalid_request("the messages render to an empty prompt", param="messages")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        delivery = Delivery(
            stream=bool(req.stream),
            include_usage=include_usage,
            user=req.user,
            cache_salt=req.cache_salt,
            session_id=req.session_id,
            prompt_cache_key=req.prompt_cache_key,
        )
        prepared = self._completions.preparer.prepare_tokens(
            req.model, prompt_ids, _predictor_text(turns), sampling, delivery, api, adapter
        )
        if tools is None:
            return prepared
        parsing = ToolCallParsing(
            fmt.begin, fmt.end, tools.names, tools.forced, legacy, named=tools.called
        )
        return replace(prepared, tool_calls=parsing)
