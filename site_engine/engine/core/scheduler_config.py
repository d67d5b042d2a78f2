"""The scheduler's limits (SchedulerConfig) and the load snapshot it reports (SchedulerStats)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fedllm_contract import spf
from fedllm_contract.priority import Priority
from site_engine.engine.core.host_offload import OffloadLimits
from site_engine.engine.core.scheduling_policy import (
    DEFAULT_SPF_MAX_OVERTAKES,
    POLICY_NAMES,
    PolicyName,
)

_POSITIVE_INT_FIELDS = (
    "num_blocks",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one engine. `watermark` is the fraction of blocks kept out of admission plans
    so that newly admitted sequences are not preempted at their first decode steps.
    `prefix_caching` shares cached prompt blocks between sequences (site_engine/engine/
    block_manager.py), their ids seeded by `model_name` and each request's cache salt;
    `host_kv_blocks` > 0 adds a host-memory tier of that many blocks, which copies blocks to
    it as `host_offload` says (site_engine/engine/core/host_offload.py).
    `background_step_tokens` is the deferral bound: the most prefill tokens of background (flex,
    batch) sequences one step computes (site_engine/engine/core/step_budget.py); 0: no bound.
    `background_step_slack` is its time side: while interactive rows run, background rows may
    add at most this fraction of the interactive part's predicted time to a step (the cost
    learned from the steps run, step_cost.py); 0: no time bound.
    `max_loras`: how many distinct LoRA adapters running sequences may use at once (the device's
    adapter slots; 0: the engine serves none). `adapter_overtake_steps`: how many steps later
    requests of the running adapters may be admitted past a waiting request whose adapter finds
    every slot taken, before one running adapter drains for it (adapter_slots.py); 128 was the
    best of 0-256 in fedsim's LoRA mix (32 Zipf adapters, 8 slots, 20 req/s for 60 s: TTFT p99
    4.5-5.5 s over three seeds against 5.5-7.4 s never draining and 6.2-8.5 s at 0).
    `adapter_blocks` > 0: adapter slots come out of the KV block pool, each resident adapter
    holding that many blocks (unified_slots.py), and max_loras is only their cap; 0: max_loras
    fixed slots beside the cache.
    `spf_aging` and `spf_max_overtakes` shape the "spf" order (scheduling_policy.py): the aging
    in tokens of rank per later arrival, and the hard bound on how many later arrivals of its
    class may be admitted ahead of a waiting sequence (None: the aging's own, (L - 1) /
    spf_aging for an expected length L; with spf_aging 0, pure SPF, there is none)."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: PolicyName = "fcfs"
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    watermark: float = 0.01
    spf_aging: float = spf.DEFAULT_AGING
    spf_max_overtakes: int | None = DEFAULT_SPF_MAX_OVERTAKES
    prefix_caching: bool = False
    model_name: str = ""
    host_kv_blocks: int = 0
    host_offload: OffloadLimits = field(default_factory=OffloadLimits)
    background_step_tokens: int = 0
    background_step_slack: float = 0.0
    max_loras: int = 0
    adapter_overtake_steps: int = 128
    adapter_blocks: int = 0

    def __post_init__(self) -> None:
        for name in _POSITIVE_INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {sorted(POLICY_NAMES)}, got {self.policy!r}")
        if not isinstance(self.eos_token_ids, frozenset):
            raise TypeError(f"eos_token_ids must be a frozenset, got {self.eos_token_ids!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if self.adapter_blocks > self.num_blocks:
            raise ValueError(
                f"an adapter takes {self.adapter_blocks} KV blocks, the cache has {self.num_blocks}"
            )
        if self.adapter_blocks < 0 or (self.adapter_blocks and not self.max_loras):
            blocks = self.adapter_blocks
            raise ValueError(f"adapter_blocks must be >= 0 (> 0 needs max_loras), got {blocks}")
        if self.adapter_overtake_steps < 0:
            raise ValueError(
                f"adapter_overtake_steps must be >= 0, got {self.adapter_overtake_steps}"
            )
        if self.spf_aging < 0:
            raise ValueError(f"spf_aging must be >= 0, got {self.spf_aging}")
        overtakes = self.spf_max_overtakes
        if overtakes is not None and (not isinstance(overtakes, int) or overtakes < 0):
            raise ValueError(f"spf_max_overtakes must be an int >= 0 or None, got {overtakes!r}")
        if self.background_step_tokens < 0:
            raise ValueError(
                f"background_step_tokens must be >= 0, got {self.background_step_tokens}"
            )
        if not 0.0 <= self.background_step_slack <= 10.0:
            raise ValueError(
                f"background_step_slack must be in [0, 10], got {self.background_step_slack}"
            )
        if self.host_kv_blocks < 0 or (self.host_kv_blocks and not self.prefix_caching):
            raise ValueError(
                f"host_kv_blocks must be >= 0 and needs prefix_caching, got {self.host_kv_blocks}"
            )

    @property
    def watermark_blocks(self) -> int:
        return int(self.num_blocks * self.watermark)

    @property
    def max_blocks_per_step(self) -> int:
        """The most blocks one step can take from the free queue: every scheduled token in a
        fresh block of its own sequence, at worst."""
        return -(-self.max_num_batched_tokens // self.block_size) + self.max_num_seqs


@dataclass(frozen=True, slots=True)
class ClassLoad:
    """One priority class's share of the load: sequences waiting and running now, and the
    preemptions its sequences suffered since start."""

    priority: Priority
    num_waiting: int
    num_running: int
    num_preemptions: int
    # Tokens, split as SchedulerStats' totals are: to prefill (waiting), held in KV (running),
    # predicted still to generate (both).
    queued_prompt_tokens: int = 0
    running_tokens: int = 0
    predicted_remaining_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot of the scheduler's load, e.g. for the gateway's routing signals.

    `queued_prompt_tokens` counts what waiting sequences must prefill when admitted (prompt, plus
    generated tokens for a preempted one). `cached_tokens` counts tokens whose KV is held now.
    The prefix cache's counters are cumulative since start, in tokens (vLLM's
    prefix_cache_queries / _hits): tokens looked up at each admission, those found cached in
    either tier, and of them those copied back from the host tier. `prompt_tokens_computed`
    counts prompt positions the model ran (recomputed ones again), `host_kv_blocks_offloaded` /
    `_onloaded` the blocks copied to / from the host tier, `host_kv_blocks_skipped_budget` the
    blocks worth a copy evicted without one because the per-step budget was spent, and
    `host_kv_blocks_declined` those evicted without one as unlikely to be read again (never hit,
    of no active conversation). `by_class`: one ClassLoad per
    priority class, interactive first.
    """

    num_waiting: int
    num_running: int
    queued_prompt_tokens: int
    predicted_remaining_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    cached_tokens: int
    iterations: int
    num_preemptions: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_host_hits: int = 0
    prompt_tokens_computed: int = 0
    kv_blocks_cached: int = 0
    host_kv_blocks_offloaded: int = 0
    host_kv_blocks_onloaded: int = 0
    host_kv_blocks_skipped_budget: int = 0
    host_kv_blocks_declined: int = 0
    by_class: tuple[ClassLoad, ...] = ()
