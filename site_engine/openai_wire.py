"""The OpenAI completion and chat requests as the site's HTTP face reads them, and the answer
objects and stream chunks it writes (openai_http.py serves them).

Like `vllm serve`, the face is lenient about fields it does not use (they are ignored), and
takes the engine-side extensions the gateway's `openai` site kind sends: a prompt of token ids,
`ignore_eos`, `return_token_ids` (vLLM's name: each choice carries its token ids, so a gateway
can continue an answer elsewhere from the exact tokens) and `generated_before` (a seeded
continuation counts its sampler on from there).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from site_engine.engine.types import SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True, slots=True)
class FaceRequest:
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    chat: bool


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise BadRequest(f"{name} must be a number", name)
    return float(value)


def _sampling(body: dict[str, Any]) -> SamplingParams:
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens")) or DEFAULT_MAX_TOKENS
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    seed, before = body.get("seed"), body.get("generated_before", 0) or 0
    if not isinstance(max_tokens, int) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("max_tokens must be an integer and stop strings", "max_tokens")
    if not isinstance(seed, int | None) or not isinstance(before, int):
        raise BadRequest("seed and generated_before must be integers", "seed")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0),
            top_p=_number(body, "top_p", 1.0),
            seed=seed,
            stop=tuple(stop),
            ignore_eos=bool(body.get("ignore_eos", False)),
            generated_before=before,
        )
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc


def _prompt_ids(prompt: object, tokenizer: PreTrainedTokenizerBase, vocab: int) -> tuple[int, ...]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = tuple(tokenizer.encode(prompt, add_special_tokens=False))
    elif isinstance(prompt, list) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in prompt
    ):
        ids = tuple(prompt)
    else:
        raise BadRequest("prompt must be a string or a list of token ids (one prompt)", "prompt")
    if not ids:
        raise BadRequest("the prompt is empty", "prompt")
    if min(ids) < 0 or max(ids) >= vocab:
        raise BadRequest(f"prompt token ids must be in 0..{vocab - 1}", "prompt")
    return ids


def _chat_ids(messages: object, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest("this model has no chat template: use /v1/completions", "model")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # the template refused the conversation
        raise BadRequest(f"the chat template refused the messages: {exc}", "messages") from exc
    return tuple(tokenizer.encode(str(text), add_special_tokens=False))


def parse_request(
    body: object, model: str, tokenizer: PreTrainedTokenizerBase, vocab: int, chat: bool
) -> FaceRequest:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if body.get("model") != model:
        raise BadRequest(f"The model `{body.get('model')}` does not exist.", "model", 404)
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported", "n")
    options = body.get("stream_options") or {}
    ids = (
        _chat_ids(body.get("messages"), tokenizer)
        if chat
        else _prompt_ids(body.get("prompt"), tokenizer, vocab)
    )
    return FaceRequest(
        prompt_token_ids=ids,
        sampling=_sampling(body),
        stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        return_token_ids=bool(body.get("return_token_ids", False)),
        chat=chat,
    )


@dataclass(slots=True)
class Answer:
    """Builds the answer's objects: one per stream chunk, or the whole completion."""

    request: FaceRequest
    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.request.chat else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _object(self, chunk: bool) -> str:
        if self.request.chat:
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    def _choice(self, text: str, ids: tuple[int, ...], reason: str | None, chunk: bool) -> Any:
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if not self.request.chat:
            choice["text"] = text
        elif chunk:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        if self.request.return_token_ids:
            choice["token_ids"] = list(ids)
        return choice

    def _head(self, chunk: bool) -> dict[str, Any]:
        return {"id": self.id, "object": self._object(chunk), "created": self.created,
                "model": self.model}  # fmt: skip

    def chunk(self, text: str, ids: tuple[int, ...], reason: str | None) -> dict[str, Any]:
        return {**self._head(True), "choices": [self._choice(text, ids, reason, True)]}

    def usage(self, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        prompt = len(self.request.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # fmt: skip

    def usage_chunk(self, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        usage = self.usage(completion_tokens, cached_tokens)
        return {**self._head(True), "choices": [], "usage": usage}

    def whole(
        self, text: str, ids: tuple[int, ...], reason: str, tokens: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        choice = self._choice(text, ids, reason, False)
        usage = self.usage(tokens, cached_tokens)
        return {**self._head(False), "choices": [choice], "usage": usage}
