"""The OpenAI sampling options beyond temperature and top-p, checked as OpenAI checks them:
`n`, presence and frequency penalties, `logit_bias`, logprobs. Bad values are 400s naming the
parameter, before anything is routed.

Shared by /v1/completions and /v1/chat/completions (and the batch items of both); the decoding
constraint (response_format, tools) is checked by its own module and joins the options here,
where it is checked once more as it will be dispatched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from fedllm_contract.grammar import ConstraintSpec, refusal
from gateway.errors import invalid_request

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat's top_logprobs
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI refuses more
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """What a request asks beyond plain sampling, validated."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    constraint: ConstraintSpec | None = None


@dataclass(frozen=True, slots=True)
class RequestedOptions:
    """The options as a client sent them (None: absent), with the wire names they came under."""

    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[str, float] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    top_logprobs_param: str = "top_logprobs"
    constraint: ConstraintSpec | None = None


def _penalty(value: float | None, param: str) -> float:
    if value is None:
        return 0.0
    if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
        raise invalid_request(f"{param} must be between -2 and 2 (got {value})", param=param)
    return float(value)


def _logit_bias(bias: Mapping[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid_request(
            f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens", param="logit_bias"
        )
    entries = []
    for key, value in bias.items():
        if not key.isdigit() or not 0 <= int(key) < vocab:
            raise invalid_request(
                f"logit_bias keys are token ids of this model's vocabulary, 0..{vocab - 1} "
                f"(got {key!r})",
                param="logit_bias",
            )
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise invalid_request(
                f"logit_bias values must be between -100 and 100 (token {key}: {value})",
                param="logit_bias",
            )
        entries.append((int(key), float(value)))
    return tuple(sorted(entries))


def check_options(asked: RequestedOptions, vocab: int, max_choices: int) -> SamplingOptions:
    """The options validated against the model's vocabulary and the gateway's bound on n."""
    n = 1 if asked.n is None else asked.n
    if not 1 <= n <= max_choices:
        raise invalid_request(
            f"n must be between 1 and {max_choices} on this gateway (got {n})", param="n"
        )
    top = asked.top_logprobs or 0
    param = asked.top_logprobs_param
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid_request(f"{param} must be between 0 and 20 (got {top})", param=param)
    if asked.top_logprobs is not None and not asked.logprobs and param == "top_logprobs":
        raise invalid_request("top_logprobs needs logprobs: true", param="logprobs")
    # Whatever built it (response_format, tools) checked it by name; this is the same verdict
    # (remembered, so free here) on exactly what is dispatched: a constraint the sites would
    # refuse never reaches one.
    why = refusal(asked.constraint) if asked.constraint is not None else ""
    if why:
        raise invalid_request(f"the answer's constraint cannot be enforced: {why}")
    return SamplingOptions(
        n=n,
        presence_penalty=_penalty(asked.presence_penalty, "presence_penalty"),
        frequency_penalty=_penalty(asked.frequency_penalty, "frequency_penalty"),
        logit_bias=_logit_bias(asked.logit_bias, vocab),
        logprobs=asked.logprobs,
        top_logprobs=top,
        constraint=asked.constraint,
    )


def check_stream_options(stream: bool | None, stream_options: object | None) -> None:
    """OpenAI's rule: stream_options only with stream true (400 otherwise)."""
    if stream_options is not None and not stream:
        raise invalid_request(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
