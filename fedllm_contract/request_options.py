"""What a request asks of its generation beyond its prompt and length: one typed value from the
gateway's HTTP edge to the site engine (issue 51).

Each boundary maps it once, field by field over `fields(RequestOptions)`, so a new option is
declared here and in site.proto (docs/development.md, "Adding a request option"):
- HTTP -> gateway: gateway/completions/sampling_options.py (`options_from_wire`, the fields a
  request carries under the same name; one call per API) and `check_options` (ranges);
- gateway -> gRPC site and gRPC -> site: fedllm_contract/proto/options.py (used only by the two
  gRPC adapters);
- gateway -> OpenAI-compatible site: gateway/sites/openai_wire.py (`option_fields`);
- site -> engine: site_engine/request_options.py (`engine_request`).

The values here are typed, not validated: the gateway checks them against the model (its
vocabulary, its bound on n) and the engine's SamplingParams checks them again.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum

from fedllm_contract.grammar import ConstraintSpec


class Priority(StrEnum):
    """Whose work a request is (FineInfer's classes): a person waiting (interactive), work that
    may wait a little for a lower price (OpenAI's `service_tier: "flex"`), or a Batches API
    item. The site engine decides what a class means for scheduling."""

    INTERACTIVE = "interactive"
    FLEX = "flex"
    BATCH = "batch"


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """The sampling and serving options of one request; the defaults are a plain request."""

    # 0 means greedy.
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Keep generating past EOS until max_tokens (benchmarks replaying exact lengths).
    ignore_eos: bool = False
    # OpenAI's penalties on tokens already generated, in [-2, 2]; 0: off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # (token id, bias) pairs sorted by token id, biases in [-100, 100].
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Report each sampled token's log probability, and top_logprobs alternatives (0..20).
    logprobs: bool = False
    top_logprobs: int = 0
    # What the answer's tokens must follow (structured outputs, tool calls).
    constraint: ConstraintSpec | None = None
    # vLLM's: > 0, 1 is off; divides positive logits (multiplies negative ones) of the tokens
    # of the prompt and the answer. No API of the gateway takes it yet.
    repetition_penalty: float = 1.0
    # Choices of this prompt (OpenAI's n), each with its own random stream.
    n: int = 1
    # The LoRA adapter the request is for; None: the base model.
    adapter: str | None = None
    priority: Priority = Priority.INTERACTIVE


OPTION_NAMES: frozenset[str] = frozenset(f.name for f in fields(RequestOptions))
