"""The OpenAI completion and chat requests as the site's HTTP face reads them, and the answer
objects and stream chunks it writes (openai_http.py serves them).

Like `vllm serve`, the face is lenient about fields it does not use (they are ignored), and
takes the engine-side extensions the gateway's `openai` site kind sends: a prompt of token ids,
`ignore_eos`, `return_token_ids` (vLLM's name: each choice carries its token ids, so a gateway
can continue an answer elsewhere from the exact tokens) and `generated_before` (a seeded
continuation counts its sampler on from there).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from transformers import PreTrainedTokenizerBase

from fedllm_contract.grammar import ConstraintSpec
from fedllm_contract.request_options import RequestOptions
from site_engine.engine.core.types import SamplingParams, TokenLogprob
from site_engine.request_options import SAMPLING_OPTIONS, sampling_params

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


MAX_CHOICES = 128


@dataclass(frozen=True, slots=True)
class FaceRequest:
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    chat: bool
    n: int = 1


def _constraint(body: dict[str, Any]) -> ConstraintSpec | None:
    """vLLM's structured_outputs ({"json": schema} or {"json_object": true}) or OpenAI's
    response_format; anything else it could ask for is refused, never ignored."""
    structured = body.get("structured_outputs")
    if isinstance(structured, dict):
        if set(structured) - {"json", "json_object"}:
            raise BadRequest("structured_outputs takes json or json_object", "structured_outputs")
        if "json" in structured:
            schema = structured["json"]
            text = schema if isinstance(schema, str) else json.dumps(schema)
            return ConstraintSpec("json_schema", schema=text)
        if structured.get("json_object"):
            return ConstraintSpec("json_object")
    elif structured is not None:
        raise BadRequest("structured_outputs must be an object", "structured_outputs")
    fmt = body.get("response_format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_object":
        return ConstraintSpec("json_object")
    spec = fmt.get("json_schema")
    if fmt.get("type") == "json_schema" and isinstance(spec, dict):
        return ConstraintSpec("json_schema", schema=json.dumps(spec.get("schema", {})))
    raise BadRequest("response_format is text, json_object or json_schema", "response_format")


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise BadRequest("logit_bias maps token ids to numbers", "logit_bias")
    try:
        return tuple((int(token), float(value)) for token, value in bias.items())
    except (TypeError, ValueError) as exc:
        raise BadRequest("logit_bias maps token ids to numbers", "logit_bias") from exc


def _logprobs(body: dict[str, Any], chat: bool) -> tuple[bool, int]:
    """(logprobs, top_logprobs): completions take a count, chat a flag and top_logprobs."""
    value = body.get("logprobs")
    if chat:
        top = body.get("top_logprobs") or 0
        return bool(value), int(top) if isinstance(top, int) else -1
    if value is None or value is False:
        return False, 0
    return True, int(value) if isinstance(value, int) else -1


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise BadRequest(f"{name} must be a number", name)
    return float(value)


# The options read below by hand (their wire form is not the option's, or the face takes them
# elsewhere: n, the model's name); every other one is read under its own name, typed by its
# default, so a new sampling option needs no code here.
_BY_HAND = frozenset(
    {"stop", "seed", "logit_bias", "logprobs", "top_logprobs", "constraint", "n", "adapter",
     "priority"}
)  # fmt: skip


def _scalar(body: dict[str, Any], name: str, default: object) -> object:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(default, bool):
        return bool(value)
    if isinstance(default, float):
        return _number(body, name, default)
    if isinstance(default, int) and isinstance(value, int) and not isinstance(value, bool):
        return value
    raise BadRequest(f"{name} must be of the type of {default!r}", name)


def _sampling(body: dict[str, Any], chat: bool = False) -> SamplingParams:
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens")) or DEFAULT_MAX_TOKENS
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    seed, before = body.get("seed"), body.get("generated_before", 0) or 0
    if not isinstance(max_tokens, int) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("max_tokens must be an integer and stop strings", "max_tokens")
    if not isinstance(seed, int | None) or not isinstance(before, int):
        raise BadRequest("seed and generated_before must be integers", "seed")
    logprobs, top = _logprobs(body, chat)
    scalars = {
        f.name: _scalar(body, f.name, f.default)
        for f in fields(RequestOptions)
        if f.name in SAMPLING_OPTIONS and f.name not in _BY_HAND
    }
    try:
        options = RequestOptions(
            seed=seed,
            stop=tuple(stop),
            logit_bias=_logit_bias(body),
            logprobs=logprobs,
            top_logprobs=top,
            constraint=_constraint(body),
            **scalars,  # type: ignore[arg-type]
        )
        return sampling_params(options, max_tokens, before)
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
    n = body.get("n") or 1
    if not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"n must be between 1 and {MAX_CHOICES}", "n")
    options = body.get("stream_options") or {}
    ids = (
        _chat_ids(body.get("messages"), tokenizer)
        if chat
        else _prompt_ids(body.get("prompt"), tokenizer, vocab)
    )
    return FaceRequest(
        prompt_token_ids=ids,
        sampling=_sampling(body, chat),
        stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        return_token_ids=bool(body.get("return_token_ids", False)),
        chat=chat,
        n=n,
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

    def _choice(
        self,
        text: str,
        ids: tuple[int, ...],
        reason: str | None,
        chunk: bool,
        index: int = 0,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> Any:
        choice: dict[str, Any] = {"index": index, "finish_reason": reason, "logprobs": None}
        if self.request.sampling.logprobs and logprobs:
            choice["logprobs"] = self._logprobs(ids, logprobs)
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

    def _logprobs(self, ids: tuple[int, ...], values: tuple[TokenLogprob, ...]) -> Any:
        """vLLM's shape of a completion's logprobs, tokens written as token ids
        ("token_id:<id>", vLLM's return_tokens_as_token_ids); chat gets the same content."""
        tokens = [f"token_id:{i}" for i in ids]
        tops = [{f"token_id:{t}": lp for t, lp in value.top} for value in values]
        if self.request.chat:
            return {"content": [
                {"token": token, "logprob": value.logprob, "bytes": None,
                 "top_logprobs": [{"token": t, "logprob": lp, "bytes": None}
                                  for t, lp in top.items()]}
                for token, value, top in zip(tokens, values, tops, strict=False)]}  # fmt: skip
        return {"tokens": tokens, "token_logprobs": [v.logprob for v in values],
                "top_logprobs": tops, "text_offset": []}  # fmt: skip

    def chunk(
        self,
        text: str,
        ids: tuple[int, ...],
        reason: str | None,
        index: int = 0,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> dict[str, Any]:
        choice = self._choice(text, ids, reason, True, index, logprobs)
        return {**self._head(True), "choices": [choice]}

    def usage(self, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        prompt = len(self.request.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # fmt: skip

    def usage_chunk(self, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        usage = self.usage(completion_tokens, cached_tokens)
        return {**self._head(True), "choices": [], "usage": usage}

    def whole(
        self, choices: list[WholeChoice], tokens: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        out = [
            self._choice(c.text, tuple(c.ids), c.reason, False, i, tuple(c.logprobs))
            for i, c in enumerate(choices)
        ]
        usage = self.usage(tokens, cached_tokens)
        return {**self._head(False), "choices": out, "usage": usage}


@dataclass(slots=True)
class WholeChoice:
    """One choice of a whole (not streamed) answer, gathered from its events."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reason: str = "stop"
