"""From a chat request to a prepared completion: validate, render the model's chat template,
tokenize, then share every later step (sampling checks, routing, dispatch) with
/v1/completions through CompletionService."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from gateway.chat.request import ChatCompletionRequest, ChatMessage
from gateway.chat.templates import (
    ChatRenderError,
    ChatTemplates,
    NoChatTemplate,
    RenderedChat,
    render_messages_as_text,
)
from gateway.completions.service import CompletionService, Delivery, PreparedCompletion, Sampling
from gateway.errors import invalid_request, model_not_found
from gateway.tokenizers import ModelTokenizers

ROLES = ("system", "user", "assistant")
# Message fields refused unless null: tool use, audio, refusals and participant names are not
# served (chat templates have no place for them).
_MESSAGE_FIELDS_REFUSED = (
    "name",
    "tool_calls",
    "tool_call_id",
    "function_call",
    "audio",
    "refusal",
)


def _neutral_response_format(value: dict[str, Any] | None) -> bool:
    return value is None or value == {"type": "text"}


# param -> (is the value one this gateway honours, what to say when it is not)
_NEUTRAL_ONLY: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: v in (None, 1), "only n=1 is supported"),
    "logprobs": (lambda v: not v, "logprobs are not supported"),
    "top_logprobs": (lambda v: v is None, "logprobs are not supported"),
    "presence_penalty": (lambda v: not v, "presence_penalty is not supported"),
    "frequency_penalty": (lambda v: not v, "frequency_penalty is not supported"),
    "logit_bias": (lambda v: not v, "logit_bias is not supported"),
    "response_format": (_neutral_response_format, "only response_format {'type': 'text'}"),
    "tool_choice": (lambda v: v in (None, "none"), "tools are not supported"),
    "store": (lambda v: not v, "stored completions are not supported"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "service tiers are not offered"),
    "modalities": (lambda v: v in (None, ["text"]), "only the text modality is supported"),
}


def reject_unsupported(req: ChatCompletionRequest) -> None:
    for param, (honoured, reason) in _NEUTRAL_ONLY.items():
        value = getattr(req, param)
        if not honoured(value):
            raise invalid_request(
                f"'{param}' is not supported by this gateway: {reason} (got {value!r})",
                param=param,
            )


def _content_text(message: ChatMessage, where: str) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    if content is None:
        raise invalid_request(f"{where}.content is required", param=f"{where}.content")
    texts = []
    for i, part in enumerate(content):
        param = f"{where}.content[{i}]"
        kind = part.get("type")
        if kind != "text":
            raise invalid_request(
                f"content parts of type {kind!r} are not supported: only 'text' parts", param=param
            )
        if set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise invalid_request(
                "a text part is exactly {'type': 'text', 'text': <string>}", param=param
            )
        texts.append(part["text"])
    # Parts are joined with newlines, as vLLM does, so that separate paragraphs stay separate.
    return "\n".join(texts)


def conversation(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages as chat templates read them: [{"role", "content"}], content as plain text."""
    if not messages:
        raise invalid_request("messages must hold at least one message", param="messages")
    turns = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.role not in ROLES:
            raise invalid_request(
                f"role {message.role!r} is not supported: use one of {', '.join(ROLES)} "
                "(tool and function messages are not served)",
                param=f"{where}.role",
            )
        for name in _MESSAGE_FIELDS_REFUSED:
            if getattr(message, name) is not None:
                raise invalid_request(
                    f"'{name}' on messages is not supported by this gateway",
                    param=f"{where}.{name}",
                )
        turns.append({"role": message.role, "content": _content_text(message, where)})
    return turns


def _predictor_text(turns: list[dict[str, str]]) -> str:
    # The length predictor was trained on single prompts: an answer's length follows the
    # question it answers, the last user message, not the template's markup.
    users = [turn["content"] for turn in turns if turn["role"] == "user"]
    return users[-1] if users else "\n".join(turn["content"] for turn in turns)


def _sampling(req: ChatCompletionRequest) -> Sampling:
    limits = {"max_tokens": req.max_tokens, "max_completion_tokens": req.max_completion_tokens}
    given = {name: value for name, value in limits.items() if value is not None}
    if len(set(given.values())) > 1:
        raise invalid_request(
            "max_tokens and max_completion_tokens disagree: send one of them "
            "(max_completion_tokens is the current name)",
            param="max_completion_tokens",
        )
    param = "max_completion_tokens" if "max_completion_tokens" in given else "max_tokens"
    return Sampling(
        max_tokens=given.get(param),
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        stop=req.stop,
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        max_tokens_param=param,
    )


class ChatService:
    def __init__(
        self,
        templates: ChatTemplates,
        tokenizers: ModelTokenizers,
        completions: CompletionService,
        parse_special_tokens: Collection[str] = (),
    ) -> None:
        self._templates = templates
        self._tokenizers = tokenizers
        self._completions = completions
        # Models whose messages may carry control tokens (the federation file's
        # parse_special_tokens_in_messages); the others' message content is text.
        self._parse_special_tokens = frozenset(parse_special_tokens)

    def _render(self, model: str, turns: list[dict[str, str]]) -> RenderedChat:
        template = self._templates[model]
        if model in self._parse_special_tokens:
            text = template.render(turns, add_generation_prompt=True)
            return RenderedChat(text, ((text, False),))
        specials = self._tokenizers.special_tokens(model)
        return render_messages_as_text(template, turns, specials, add_generation_prompt=True)

    def prepare(self, req: ChatCompletionRequest) -> PreparedCompletion:
        """Validates, renders and tokenizes; raises GatewayError (4xx) without touching any
        state. Dispatch is then CompletionService.dispatch, as for /v1/completions."""
        if req.model not in self._templates or req.model not in self._tokenizers:
            raise model_not_found(req.model)
        reject_unsupported(req)
        turns = conversation(req.messages)
        sampling = _sampling(req)
        try:
            rendered = self._render(req.model, turns)
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
        self._completions.check_prompt_chars(req.model, rendered.text, "messages")
        prompt_ids = self._tokenizers.encode_pieces(req.model, rendered.pieces)
        if not prompt_ids:
            raise invalid_request("the messages render to an empty prompt", param="messages")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        delivery = Delivery(
            stream=bool(req.stream),
            include_usage=include_usage,
            user=req.user,
            cache_salt=req.cache_salt,
        )
        return self._completions.prepare_tokens(
            req.model, prompt_ids, _predictor_text(turns), sampling, delivery, "chat.completions"
        )
