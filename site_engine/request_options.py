"""A request's options (fedllm_contract/request_options.py) as the engine takes them: the one
mapping from the contract's value to the engine's request, field by field.

Every option that is a field of the engine's SamplingParams is passed under its name; the others
are the serving layer's (n: the service runs one sequence per choice) or ride on the
EngineRequest itself (adapter, priority). A new sampling option needs no code here: it is a
field of SamplingParams, where the engine uses it.
"""

from __future__ import annotations

from dataclasses import fields

from fedllm_contract.request_options import OPTION_NAMES, RequestOptions
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams

SAMPLING_OPTIONS = frozenset(f.name for f in fields(SamplingParams)) & OPTION_NAMES
# The options the engine's SamplingParams does not hold, and where they go instead.
NOT_SAMPLING = frozenset({"n", "adapter", "priority"})


def sampling_params(
    options: RequestOptions, max_tokens: int, generated_before: int = 0
) -> SamplingParams:
    """Raises ValueError for a value the engine refuses."""
    shared = {name: getattr(options, name) for name in SAMPLING_OPTIONS}
    return SamplingParams(max_tokens=max_tokens, generated_before=generated_before, **shared)


def engine_request(
    request_id: str,
    prompt_token_ids: tuple[int, ...],
    options: RequestOptions,
    max_tokens: int,
    generated_before: int = 0,
    predicted_tokens: int | None = None,
    cache_salt: str = "",
) -> EngineRequest:
    """The engine's request for one prompt (an empty adapter name is the base model). Raises
    ValueError for a value the engine refuses."""
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling=sampling_params(options, max_tokens, generated_before),
        predicted_tokens=predicted_tokens,
        cache_salt=cache_salt,
        adapter=options.adapter or None,
        priority=options.priority,
    )
