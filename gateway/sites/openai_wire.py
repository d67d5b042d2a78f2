"""The OpenAI HTTP API as the gateway speaks it to an engine: the completion request it sends,
the server-sent events it reads back, and the engine's errors as the interface's failures.

The SSE subset OpenAI-compatible servers use is small (one `data:` line per event, `[DONE]` at
the end), so it is parsed here rather than with a dependency.
"""

from __future__ import annotations

import base64
import binascii
import json
from array import array
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, fields
from typing import Any

from fedllm_contract.request_options import RequestOptions
from gateway.federation import StructuredDialect
from gateway.sites.interface import (
    Capability,
    EmbedParams,
    GenerateParams,
    SiteBusy,
    SiteCallError,
    SiteFailed,
    SiteRejected,
    SiteUnavailable,
    TokenLogprob,
)

DONE = "[DONE]"
# An engine's own finish reasons that mean the answer really ended; any other (vLLM's "abort",
# an engine error) means the engine broke under it, and the answer continues elsewhere.
_FINISHED = {"stop", "length"}
# Longest SSE line accepted: a token's event is tiny; a runaway line is a broken engine.
MAX_LINE_CHARS = 1 << 20


class MalformedStream(ValueError):
    """The engine's event stream (or answer) is not what the OpenAI API sends."""


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One completion chunk, reduced to what dispatch needs."""

    text: str = ""
    token_ids: tuple[int, ...] | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()


_PLAIN_CAPABILITIES: frozenset[Capability] = frozenset(("n", "logprobs", "penalties", "logit_bias"))


def capabilities(dialect: StructuredDialect) -> frozenset[Capability]:
    """What an OpenAI-compatible engine takes on /v1/completions: n, logprobs, penalties and
    logit_bias always (vLLM, SGLang and TGI all do); JSON schemas in its structured-output
    dialect; never tagged JSON (tool calls are constrained only on our own gRPC sites)."""
    if dialect == "none":
        return _PLAIN_CAPABILITIES
    return _PLAIN_CAPABILITIES | {"json_schema", "json_object"}


def _structured(options: RequestOptions, dialect: StructuredDialect) -> dict[str, Any]:
    spec = options.constraint
    if spec is None or dialect == "none":
        return {}
    schema = spec.schema if spec.kind == "json_schema" else '{"type": "object"}'
    if dialect == "sglang":
        return {"json_schema": schema}
    if spec.kind == "json_object":
        return {"structured_outputs": {"json_object": True}}
    return {"structured_outputs": {"json": json.loads(schema)}}


_Field = Callable[[RequestOptions, StructuredDialect], dict[str, Any]]
# The options that are not sent as the body field of the same name when not at their default.
_FIELDS: dict[str, _Field] = {
    # Always sent: an engine's own default may be its model's generation config, not 1.
    "temperature": lambda o, _: {"temperature": o.temperature},
    "top_p": lambda o, _: {"top_p": o.top_p},
    "stop": lambda o, _: {"stop": list(o.stop)} if o.stop else {},
    "logit_bias": lambda o, _: (
        {"logit_bias": {str(token): bias for token, bias in o.logit_bias}} if o.logit_bias else {}
    ),
    # Completions' logprobs: the sampled token's plus k alternatives.
    "logprobs": lambda o, _: {"logprobs": o.top_logprobs} if o.logprobs else {},
    "top_logprobs": lambda o, _: {},
    "constraint": _structured,
    # vLLM serves each LoRA adapter as a model of its own name.
    "adapter": lambda o, _: {"model": o.adapter} if o.adapter else {},
    # vLLM's `priority` is an integer honoured only under its priority scheduling policy (and
    # refused otherwise): the class is not sent.
    "priority": lambda o, _: {},
}


def option_fields(options: RequestOptions, dialect: StructuredDialect) -> dict[str, Any]:
    """The request's options as /v1/completions body fields: each under its own name when it
    is not at its default (vLLM, SGLang and TGI name them as OpenAI does), else as _FIELDS
    says."""
    body: dict[str, Any] = {}
    for field in fields(RequestOptions):
        value = getattr(options, field.name)
        if field.name in _FIELDS:
            body.update(_FIELDS[field.name](options, dialect))
        elif value != field.default:
            body[field.name] = value
    return body


def completion_body(
    params: GenerateParams,
    engine_model: str,
    request_token_ids: bool,
    dialect: StructuredDialect = "vllm",
) -> dict[str, Any]:
    """A streaming /v1/completions request for the params. The prompt goes as token ids (the
    gateway tokenized it; vLLM, SGLang and our engine take them), so the engine sees exactly the
    tokens that were counted and predicted."""
    body: dict[str, Any] = {
        "model": engine_model,
        "prompt": list(params.prompt_token_ids),
        "max_tokens": params.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request_token_ids:
        body["return_token_ids"] = True
    if params.generated_before:
        # Our engine's seeded sampler counts on from here; other engines ignore the field.
        body["generated_before"] = params.generated_before
    return {**body, **option_fields(params.options, dialect)}


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_event(data: str) -> StreamEvent:
    try:
        event = json.loads(data)
    except ValueError as exc:
        raise MalformedStream(f"an event is not JSON: {data[:80]!r}") from exc
    if not isinstance(event, dict):
        raise MalformedStream("an event is not a JSON object")
    if "error" in event:
        raise MalformedStream(f"the engine failed mid-stream: {error_message(event)}")
    usage = event.get("usage") or {}
    choices = event.get("choices")
    if not isinstance(choices, list) or not isinstance(usage, dict):
        raise MalformedStream("an event has no 'choices' list")
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not choices:
        return StreamEvent(prompt_tokens=_int_or_none(prompt),
                           completion_tokens=_int_or_none(completion))  # fmt: skip
    choice = choices[0]
    text = choice.get("text") if isinstance(choice, dict) else None
    if not isinstance(text, str):
        raise MalformedStream("a choice has no 'text'")
    ids = choice.get("token_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
        raise MalformedStream("a choice's 'token_ids' is not a list of integers")
    reason = choice.get("finish_reason")
    return StreamEvent(
        text=text,
        token_ids=tuple(ids) if ids is not None else None,
        finish_reason=reason if isinstance(reason, str) else None,
        prompt_tokens=_int_or_none(prompt),
        completion_tokens=_int_or_none(completion),
        index=_int_or_none(choice.get("index")) or 0,
        logprobs=_logprobs(choice.get("logprobs")),
    )


def _token(text: str) -> tuple[int | None, str | None]:
    """An alternative as (id, text): vLLM writes "token_id:<id>" with return_tokens_as_token_ids
    (and our engine's face always does)."""
    if text.startswith("token_id:") and text[9:].isdigit():
        return int(text[9:]), None
    return None, text


def _logprobs(value: object) -> tuple[TokenLogprob, ...]:
    """A completion choice's logprobs ({"token_logprobs": [...], "top_logprobs": [{text:
    logprob}]}) as the interface's values (alternatives known by their text)."""
    if not isinstance(value, dict):
        return ()
    chosen = value.get("token_logprobs")
    tops = value.get("top_logprobs") or []
    if not isinstance(chosen, list) or not isinstance(tops, list):
        raise MalformedStream("a choice's logprobs are not lists")
    out = []
    for i, logprob in enumerate(chosen):
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        alternatives = tuple((*_token(str(t)), float(lp)) for t, lp in top.items())
        out.append(TokenLogprob(float(logprob or 0.0), alternatives))
    return tuple(out)


def is_finished(reason: str | None) -> bool:
    return reason in _FINISHED


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The `data:` payloads of an event stream, one per event (comments and other fields
    skipped, multi-line data joined with newlines as the SSE specification says)."""
    data: list[str] = []
    async for line in lines:
        if len(line) > MAX_LINE_CHARS:
            raise MalformedStream("an event line is longer than 1 MiB")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def error_message(body: object) -> str:
    """The message of an OpenAI-shaped error body (`{"error": {...}}`, or vLLM's older flat
    `{"object": "error", "message": ...}`), or the body itself cut short."""
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
    return str(body)[:200]


def http_failure(site: str, status: int, body: object, engine_model: str) -> SiteCallError:
    """An engine's refusal as the failure dispatch acts on. The client's own fault (a bad
    request) is SiteRejected; a model the engine does not know, a key it refuses, a full queue
    or an engine error mean this site cannot serve it now: try another."""
    message = error_message(body)
    if status == 404 or (status in (400, 422) and "model" in message.lower()
                         and engine_model in message):  # fmt: skip
        return SiteUnavailable(site, f"the engine does not serve model {engine_model!r}: {message}")
    if status in (401, 403):
        return SiteUnavailable(site, f"the engine refused the gateway's API key ({status})")
    if status == 429:
        return SiteBusy(site, f"the engine is overloaded (429): {message}")
    if status in (400, 413, 422):
        return SiteRejected(site, message)
    if status >= 500 or status == 408:
        return SiteUnavailable(site, f"the engine answered {status}: {message}")
    return SiteFailed(site, f"unexpected status {status}: {message}")


def embedding_body(params: EmbedParams, engine_model: str) -> dict[str, Any]:
    """/v1/embeddings as the gateway sends it: the inputs as token-id lists (tokenized once, at
    the gateway, with the model's tokenizer: what was counted is what is embedded), vectors as
    floats (what every OpenAI-compatible engine answers)."""
    body: dict[str, Any] = {
        "model": engine_model,
        "input": [list(ids) for ids in params.inputs],
        "encoding_format": "float",
    }
    if params.dimensions is not None:
        body["dimensions"] = params.dimensions
    return body


def _vector(value: object) -> bytes:
    if isinstance(value, str):  # base64, from an engine that answers it whatever was asked
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error as exc:
            raise MalformedStream(f"an embedding is not base64: {exc}") from exc
    if isinstance(value, list) and all(
        isinstance(x, int | float) and not isinstance(x, bool) for x in value
    ):
        return array("f", value).tobytes()
    raise MalformedStream("an embedding is neither a list of numbers nor base64")


def parse_embeddings(body: object, inputs: int) -> tuple[bytes, ...]:
    """The vectors of an engine's /v1/embeddings answer, in input order (by `index`), as
    float32 little-endian bytes."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or len(data) != inputs:
        raise MalformedStream(f"the answer does not hold {inputs} embeddings")
    vectors: list[bytes | None] = [None] * inputs
    for position, item in enumerate(data):
        if not isinstance(item, dict):
            raise MalformedStream("an embedding item is not an object")
        index = item.get("index", position)
        if not isinstance(index, int) or not 0 <= index < inputs or vectors[index] is not None:
            raise MalformedStream(f"an embedding has a wrong index {index!r}")
        vectors[index] = _vector(item.get("embedding"))
    return tuple(v for v in vectors if v is not None)
