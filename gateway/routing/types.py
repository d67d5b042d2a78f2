"""Contracts of routing: a policy is a profile (gateway/routing/profile.py): filters (who may take
the request), weighted scorers (how good each survivor is, a number in [0, 1], higher is better)
and a picker (who takes it). A scorer often normalizes a cost (requests, tokens, seconds: lower
is better, in its own unit; gateway/routing/costs.py).

Every part reads only in-memory state, so a routing decision never waits on I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar, runtime_checkable

from fedllm_contract.block_hash import prompt_block_hashes
from gateway.routing.adapter_residency import AdapterTier


class LoadedSite(Protocol):
    """A site's name, model, health and load: what routing and a batch's assignment
    (gateway/batches/plan.py) both read. All values are the gateway's current view; reading them
    never blocks."""

    @property
    def name(self) -> str: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def model(self) -> str: ...

    @property
    def capacity_weight(self) -> float:
        """Relative capacity (> 0): a site with weight 2 is meant to carry twice the load of a
        site with weight 1. Loads are divided by it before sites are compared."""
        ...

    @property
    def outstanding_tokens(self) -> int:
        """Token load at the site as the gateway sees it: queued + running prompt tokens plus the
        predicted remaining answer tokens, from the site's load reports combined with the
        gateway's own in-flight ledger."""
        ...


class RoutableSite(LoadedSite, Protocol):
    """What routing may read about a site. All values are the gateway's current view; reading
    them never blocks."""

    @property
    def max_model_len(self) -> int | None: ...

    @property
    def kv_capacity_tokens(self) -> int | None:
        """KV cache size in tokens (blocks_total * block_size); None until the site reported it."""
        ...

    @property
    def in_flight(self) -> int:
        """Requests this gateway has sent to the site that have not finished yet."""
        ...

    @property
    def draining(self) -> bool:
        """An operator is draining the site (admin API): it takes nothing new."""
        ...

    @property
    def queued_requests(self) -> int:
        """Requests waiting at the site to start: the larger of its last load report and what
        this gateway's own in-flight count beyond the site's batch slots implies."""
        ...

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens of the requests waiting at the site (its last load report)."""
        ...

    @property
    def ledger_tokens(self) -> int:
        """This gateway's own ledger of the site's load: prompt + planned answer of each request
        it sent there, less what has streamed back. Unlike outstanding_tokens it never reads the
        site's reports, which plan with the site's own view of each answer."""
        ...

    @property
    def latency(self) -> SiteLatency:
        """What the latency-aware scorer reads: measured round trip, engine step time, batch
        occupancy (SiteLatency)."""
        ...

    @property
    def prefix(self) -> PrefixView:
        """What the gateway knows of the site's prefix cache (gateway/routing/prefix/)."""
        ...

    @property
    def adapters(self) -> frozenset[str]:
        """The LoRA adapters of its model the site serves (its SiteInfo; none: the base only)."""
        ...

    @property
    def adapter_residency(self) -> AdapterView:
        """Where the site's adapters are: device slot, host memory or disk
        (gateway/routing/adapter_residency.py)."""
        ...

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Prompt tokens the site computes per second: the federation file's (measured by the
        operator, as llm-d's peakPrefillThroughput is), else what the site's load reports
        measured; None: neither (the routing profile's figure applies)."""
        ...


@dataclass(frozen=True, slots=True)
class StepTime:
    """An engine step's duration at batch size b: base_s + per_sequence_s * b (seconds). A step
    emits one token for every running sequence, so it is also each sequence's time per token."""

    base_s: float
    per_sequence_s: float = 0.0

    def at(self, batch: int) -> float:
        return self.base_s + self.per_sequence_s * max(batch, 1)


@dataclass(frozen=True, slots=True)
class SiteLatency:
    """A site's latency signals as the gateway sees them. rtt_s None: not measured yet;
    step None: the site never reported decoding yet; batch_slots None: its info is unknown.
    requests: requests at the site (running + queued: the larger of its last report and this
    gateway's own in-flight count); remaining_answer_tokens: predicted answer tokens still to
    generate over those requests (its last report)."""

    rtt_s: float | None = None
    step: StepTime | None = None
    batch_slots: int | None = None
    requests: int = 0
    remaining_answer_tokens: int = 0

    @property
    def full(self) -> bool:
        """Every batch slot taken: a new request waits for one. Never when the slots are
        unknown (None, or 0 from an engine that does not say)."""
        slots = self.batch_slots
        return slots is not None and slots > 0 and self.requests >= slots


S = TypeVar("S", bound=RoutableSite)
T = TypeVar("T")


# What routing plans for an answer without a prediction (no predictor, or it failed):
# "max_tokens", the most the site will generate (safe for the KV bound; pessimistic when
# clients send large max_tokens by habit), "prompt_only", nothing (balance prompts alone), or
# "prompt_ratio", PROMPT_RATIO times the prompt (the guess of routers that have no predictor;
# online routing only: where no prompt length is at hand, as in the batch API's lane order, it
# plans nothing, like prompt_only). GATEWAY_PLAN_WITHOUT_PREDICTION.
UnpredictedPlan = Literal["max_tokens", "prompt_only", "prompt_ratio"]
UNPREDICTED_PLANS: tuple[UnpredictedPlan, ...] = ("max_tokens", "prompt_only", "prompt_ratio")
PROMPT_RATIO = 1.5


def planned_answer_tokens(
    predicted_tokens: int | None,
    max_tokens: int,
    unpredicted: UnpredictedPlan,
    prompt_tokens: int = 0,
) -> int:
    """Contract: the prediction capped at max_tokens (the site stops there); without one,
    max_tokens, 0, or ceil(PROMPT_RATIO * prompt_tokens) capped at max_tokens, as `unpredicted`
    says."""
    if predicted_tokens is not None:
        return min(predicted_tokens, max_tokens)
    if unpredicted == "max_tokens":
        return max_tokens
    if unpredicted == "prompt_ratio":
        return min(math.ceil(PROMPT_RATIO * prompt_tokens), max_tokens)
    return 0


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    model: str
    prompt_tokens: int
    max_tokens: int
    predicted_tokens: int | None = None
    # The predictor's length bucket; MICO alternates equally loaded sites per bucket.
    predicted_bucket: int | None = None
    unpredicted: UnpredictedPlan = "max_tokens"
    # The prompt itself (empty: unknown, nothing can be matched against a prefix cache) and the
    # cache salt its blocks are hashed with (fedllm_contract/block_hash.py).
    prompt_token_ids: tuple[int, ...] = ()
    cache_salt: str = ""
    # Whose conversation this is (session_id, user or prompt_cache_key): optional affinity.
    session_key: str | None = None
    # The LoRA adapter of `model` the request is for (None: the base): only a site listing it
    # serves the request, and its blocks are hashed apart from the base's.
    adapter: str | None = None
    # Block ids by block size, computed on first use: sites of one block size share them.
    _block_ids: dict[int, tuple[int, ...]] = field(
        init=False, default_factory=dict, compare=False, repr=False
    )

    def block_ids(self, block_size: int) -> tuple[int, ...]:
        """Contract: the ids of the prompt's full blocks of `block_size` tokens, as every site
        computes them (fedllm_contract.block_hash.prompt_block_hashes over model and cache
        salt); computed once per block size."""
        ids = self._block_ids.get(block_size)
        if ids is None:
            ids = tuple(
                prompt_block_hashes(
                    self.prompt_token_ids,
                    block_size,
                    self.model,
                    self.cache_salt,
                    self.adapter or "",
                )
            )
            self._block_ids[block_size] = ids
        return ids

    # Choices of the prompt (OpenAI's n): each needs max_tokens of context, and routing plans
    # n answers (they share the prompt's KV through the site's prefix cache).
    n: int = 1

    @property
    def answer_tokens(self) -> int:
        """The answer length routing plans with (planned_answer_tokens), over every choice."""
        one = planned_answer_tokens(
            self.predicted_tokens, self.max_tokens, self.unpredicted, self.prompt_tokens
        )
        return one * self.n

    @property
    def total_tokens(self) -> int:
        """Prompt plus planned answer: the tokens this request adds to a site's load and KV."""
        return self.prompt_tokens + self.answer_tokens


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a prompt a site holds: the longest run of the prompt's full blocks from its
    first one, each held in some tier (cached_tokens), and of that run the blocks held in device
    memory (device_tokens <= cached_tokens); the others are in the host tier and come back over
    PCIe. Only whole blocks count: the partial last block is always computed."""

    cached_tokens: int = 0
    device_tokens: int = 0


NO_MATCH = PrefixMatch()


class AdapterView(Protocol):
    """A site's LoRA adapter residency as routing sees it (SiteAdapters)."""

    def tier(self, adapter: str) -> AdapterTier: ...

    @property
    def load_s(self) -> float | None:
        """Seconds a read of an adapter from disk took there lately; None: not measured."""
        ...

    def routed(self, adapter: str) -> None:
        """A request of `adapter` was routed to this site (it loads the adapter now)."""
        ...


class PrefixView(Protocol):
    """A site's prefix cache as routing sees it (gateway/routing/prefix/site_prefix.py)."""

    def match(self, request: RoutingRequest) -> PrefixMatch: ...

    def routed(self, request: RoutingRequest) -> None:
        """The request was routed to this site (what an index without cache events learns)."""
        ...


@dataclass(frozen=True, slots=True)
class Scored:
    """A scorer's answer for the candidates, in their order: values in [0, 1], higher is better;
    costs, when the scorer normalizes a cost, are the raw costs behind them (lower is better,
    in the cost's unit), kept to explain the decision."""

    values: tuple[float, ...]
    costs: tuple[float, ...] | None = None


class SiteCost(Protocol):
    """A cost of placing the request on a site, lower is better, in its own unit (requests,
    tokens, seconds). Pure: the same inputs give the same cost."""

    @property
    def name(self) -> str: ...

    def cost(self, request: RoutingRequest, site: RoutableSite) -> float: ...


class SiteScorer(Protocol):
    """Scores every candidate for a request: one value in [0, 1] per site, higher is better."""

    @property
    def name(self) -> str: ...

    def score(self, request: RoutingRequest, sites: Sequence[RoutableSite]) -> Scored: ...


class SiteFilter(Protocol):
    """Keeps the sites that may take the request; order is preserved, nothing is added."""

    @property
    def name(self) -> str: ...

    def __call__(self, request: RoutingRequest, sites: Sequence[S]) -> list[S]: ...


class SitePicker(Protocol):
    """Chooses one site among the filtered candidates from their weighted total scores (one per
    candidate, in their order), or None when there are none."""

    @property
    def name(self) -> str: ...

    def pick(
        self, request: RoutingRequest, sites: Sequence[S], totals: Sequence[float]
    ) -> S | None: ...


@runtime_checkable
class RoutingObserver(Protocol):
    """A part that learns from each decision (a session's last site, what a site was sent)."""

    def routed(self, request: RoutingRequest, site: RoutableSite) -> None: ...
