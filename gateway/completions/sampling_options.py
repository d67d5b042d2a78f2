"""A request's options (fedllm_contract.request_options.RequestOptions) from the OpenAI APIs,
checked as OpenAI checks them: bad values are 400s naming the parameter, before anything is
routed.

`options_from_wire` is the one mapping from an API request: every option the request carries
under the same name is taken, so a new option needs no code here unless its wire form or its
range differs. Shared by /v1/completions and /v1/chat/completions (and the Responses API and
the batch items, which go through them); the decoding constraint (response_format, tools) is
checked by its own module and joins the options here, where it is checked once more as it will
be dispatched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, replace

from fedllm_contract.grammar import refusal
from fedllm_contract.request_options import Priority, RequestOptions
from gateway.errors import invalid_request

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat's top_logprobs
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI refuses more
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0
MAX_STOP_SEQUENCES = 4
# Stop strings are matched after every token; the site refuses longer ones (MAX_STOP_CHARS there).
MAX_STOP_CHARS = 1024
# OpenAI's service tiers as the site engines' priority classes: "flex" trades latency for
# price; the others (auto, default, and the tiers chat accepts and ignores) are interactive.
TIER_PRIORITY: dict[str, Priority] = {"flex": Priority.FLEX}


def served_tier(priority: Priority) -> str:
    """The `service_tier` an answer carries, as OpenAI tells the tier it served in: "flex" for
    the flex class, "default" for the rest (a batch item is served as OpenAI's batches are,
    at the default tier's answers)."""
    return "flex" if priority == Priority.FLEX else "default"


def _stop(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _bias_entries(bias: Mapping[str, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as sorted (token, bias) pairs; the ids are checked against the
    model's vocabulary by check_options."""
    entries = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise invalid_request(
                f"logit_bias keys are token ids of this model's vocabulary (got {key!r})",
                param="logit_bias",
            )
        entries.append((int(key), float(value)))
    return tuple(sorted(entries))


# The options whose wire form differs from RequestOptions' (the others are taken as they are).
_FROM_WIRE: dict[str, Callable[[object], object]] = {
    "stop": _stop,  # type: ignore[dict-item]
    "logit_bias": _bias_entries,  # type: ignore[dict-item]
}


def options_from_wire(request: object, **given: object) -> RequestOptions:
    """The options of an API request: each field of RequestOptions the request has under the
    same name (absent or None: the default), in RequestOptions' form; `given` overrides the
    fields an API names or means differently (completions' numeric logprobs, chat's service
    tier, a constraint built from response_format or tools)."""
    values: dict[str, object] = {}
    for field in fields(RequestOptions):
        value = given[field.name] if field.name in given else getattr(request, field.name, None)
        if value is None:
            continue
        convert = _FROM_WIRE.get(field.name)
        values[field.name] = convert(value) if convert is not None else value
    return RequestOptions(**values)  # type: ignore[arg-type]


def _penalty(value: float, param: str) -> float:
    if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
        raise invalid_request(f"{param} must be between -2 and 2 (got {value})", param=param)
    return float(value)


def _check_logit_bias(bias: tuple[tuple[int, float], ...], vocab: int) -> None:
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid_request(
            f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens", param="logit_bias"
        )
    for token, value in bias:
        if not 0 <= token < vocab:
            raise invalid_request(
                f"logit_bias keys are token ids of this model's vocabulary, 0..{vocab - 1} "
                f"(got {str(token)!r})",
                param="logit_bias",
            )
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise invalid_request(
                f"logit_bias values must be between -100 and 100 (token {token}: {value})",
                param="logit_bias",
            )


def _check_stop_and_seed(options: RequestOptions) -> None:
    stop = options.stop
    if len(stop) > MAX_STOP_SEQUENCES or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise invalid_request(
            f"stop takes up to 4 non-empty strings of up to {MAX_STOP_CHARS} characters",
            param="stop",
        )
    if options.seed is not None and not 0 <= options.seed < 2**63:
        raise invalid_request("seed must be in [0, 2^63)", param="seed")


def check_options(
    options: RequestOptions,
    vocab: int,
    max_choices: int,
    top_logprobs_param: str = "top_logprobs",
) -> RequestOptions:
    """The options checked against the model's vocabulary and the gateway's bound on n;
    `top_logprobs_param` is the wire name of the alternatives' count (completions' logprobs)."""
    if not 1 <= options.n <= max_choices:
        raise invalid_request(
            f"n must be between 1 and {max_choices} on this gateway (got {options.n})", param="n"
        )
    top = options.top_logprobs
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid_request(
            f"{top_logprobs_param} must be between 0 and 20 (got {top})", param=top_logprobs_param
        )
    _check_stop_and_seed(options)
    _check_logit_bias(options.logit_bias, vocab)
    # Whatever built it (response_format, tools) checked it by name; this is the same verdict
    # (remembered, so free here) on exactly what is dispatched: a constraint the sites would
    # refuse never reaches one.
    why = refusal(options.constraint) if options.constraint is not None else ""
    if why:
        raise invalid_request(f"the answer's constraint cannot be enforced: {why}")
    return replace(
        options,
        presence_penalty=_penalty(options.presence_penalty, "presence_penalty"),
        frequency_penalty=_penalty(options.frequency_penalty, "frequency_penalty"),
    )


def check_stream_options(stream: bool | None, stream_options: object | None) -> None:
    """OpenAI's rule: stream_options only with stream true (400 otherwise)."""
    if stream_options is not None and not stream:
        raise invalid_request(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
