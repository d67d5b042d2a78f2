"""What a site engine is built with (EngineConfig) and how much KV cache it gets (plan_kv)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from site_engine.engine.core.host_offload import OffloadLimits
from site_engine.engine.core.scheduling_policy import PolicyName
from site_engine.engine.kv_cache import KVCacheSpec, kv_cache_bytes_per_block
from site_engine.engine.lora.adapter import BaseShapes
from site_engine.engine.lora.registry import LoraSettings, lora_slot_bytes
from site_engine.engine.memory_plan import KvPlan, blocks_for, plan_from_budget, plan_kv_cache
from site_engine.model_loading import LoadedModel

# On CPU without an explicit budget: room for this many full-length sequences.
_CPU_DEFAULT_FULL_SEQUENCES = 4


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    # KV cache budget in bytes; 0 chooses one from the device (see plan_kv).
    kv_cache_bytes: int = 0
    policy: PolicyName = "fcfs"
    # CUDA only: replay decode steps of up to max_num_seqs sequences from CUDA graphs, and steps
    # with prefill chunks (up to max_num_batched_tokens tokens) from flat step graphs.
    cuda_graphs: bool = True
    # Schedule step N+1 while step N runs. None: on for CUDA, off elsewhere (a CPU step does its
    # work before returning, so there is nothing to overlap; True still works there, for tests).
    async_scheduling: bool | None = None
    # Automatic prefix caching (site_engine/engine/core/block_manager.py); block ids are seeded by
    # `model_name`, the name the gateway routes by, so that it computes the same ids.
    prefix_caching: bool = True
    model_name: str = ""
    # Bytes of host memory for the prefix cache's second tier (0: none; needs prefix_caching).
    host_kv_cache_bytes: int = 0
    # The host tier's bandwidth share: bytes of copies to it decided per step at most (whole
    # blocks; at least one block's worth), and how many steps after its request left a block
    # counts as of an active conversation (site_engine/engine/core/host_offload.py).
    host_kv_offload_bytes_per_step: int = 32 << 20
    host_kv_active_window_steps: int = 2000
    # Constrained requests' grammars compile on this many threads of their own, off the step
    # loop; one that takes longer than the timeout fails its requests (a 400 for the client).
    grammar_compile_threads: int = 2
    grammar_compile_timeout_s: float = 5.0
    # The deferral bound: background (flex, batch) prefill tokens per step at most; 0: none
    # (site_engine/engine/core/step_budget.py).
    background_step_tokens: int = 0
    # Its time side: background rows may add at most this fraction of a step's interactive
    # part (its cost learned from the steps run: site_engine/engine/core/step_cost.py); 0: none.
    background_step_slack: float = 0.0
    # Whether step() times itself for that cost (the wall clock); False: the owner reports each
    # step's seconds with record_step_seconds (a benchmark on a clock of its own).
    measure_step_time: bool = True
    # LoRA adapters this engine serves (site_engine/engine/lora/); None: the base model only.
    lora: LoraSettings | None = None
    # Device memory reserved for fine-tuning jobs (site_engine/finetune/), taken from the KV
    # cache's automatic budget (or refused with an explicit one it leaves no room beside).
    finetune_reserve_bytes: int = 0
    # The reserve held only while a job trains: the cache is planned at full size and the
    # reserve's blocks are drained and lent to the trainer when a job starts, given back when
    # none runs (reserve_kv / release_kv_reserve; the site's SITE_FINETUNE_RESERVE_ON_DEMAND).
    finetune_reserve_on_demand: bool = False
    # CUDA only: start with no graph captured, serve at once (steps without their graph run
    # eagerly) and capture the graphs one at a time between steps (core/graph_capture.py).
    # Off for an engine built in code; a CUDA site turns it on (SiteSettings.load, docs/elastic.md).
    lazy_graphs: bool = False
    # Lazy graphs' pace (core/graph_capture.CapturePolicy): one capture per this many steps
    # while requests run; captures per idle loop turn for up to this many seconds.
    graph_capture_every_steps: int = 8
    graph_capture_idle_s: float = 0.05


def plan_kv(loaded: LoadedModel, config: EngineConfig) -> KvPlan:
    """The KV cache's blocks. On CUDA from a memory trial of the largest step, graphs and
    sampler (site_engine/engine/memory_trial.py), refusing settings that cannot fit; elsewhere
    the configured budget or room for a few full-length sequences."""
    spec = KVCacheSpec.from_config(loaded.model.config)
    per_block = kv_cache_bytes_per_block(spec, config.block_size, loaded.dtype)
    sizes = {"bytes_per_block": per_block, "block_size": config.block_size,
             "max_model_len": loaded.max_model_len}  # fmt: skip
    if loaded.device.type == "cuda":
        from site_engine.engine.memory_trial import run_trial

        measurement = run_trial(
            loaded,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size,
            cuda_graphs=config.cuda_graphs,
        )
        if config.lora is not None:
            # The trial runs no adapter: the slots (every projection's, allocated up front for
            # the graphs) come out of what the cache may take.
            lora = lora_slot_bytes(BaseShapes.of_model(loaded.model), config.lora, loaded.dtype)
            measurement = replace(measurement, free=measurement.free - lora)
        return plan_kv_cache(
            measurement,
            requested_bytes=config.kv_cache_bytes,
            training_bytes=0
            if config.finetune_reserve_on_demand
            else config.finetune_reserve_bytes,
            **sizes,
        )
    if config.kv_cache_bytes > 0:
        return plan_from_budget(config.kv_cache_bytes, **sizes)
    full = blocks_for(loaded.max_model_len, config.block_size)
    blocks = full * min(config.max_num_seqs, _CPU_DEFAULT_FULL_SEQUENCES)
    return KvPlan(blocks, config.block_size, per_block, loaded.max_model_len, None, 0)


def kv_cache_blocks(loaded: LoadedModel, config: EngineConfig) -> int:
    """Blocks for the configured budget, or a device-derived default."""
    return plan_kv(loaded, config).num_blocks


def offload_limits(config: EngineConfig, block_bytes: int) -> OffloadLimits:
    blocks = config.host_kv_offload_bytes_per_step // block_bytes
    if config.host_kv_cache_bytes and blocks < 1:
        raise ValueError(
            f"host_kv_offload_bytes_per_step ({config.host_kv_offload_bytes_per_step}) must "
            f"cover at least one KV block of {block_bytes} bytes"
        )
    return OffloadLimits(max(blocks, 1), config.host_kv_active_window_steps)
