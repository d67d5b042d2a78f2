"""The site's engine: iteration-level scheduling over a paged KV cache.

One step is three calls: the scheduler decides (pure Python), the model runner computes (torch),
the scheduler takes the results. Finished sequences leave and waiting ones enter at the very
next step (MICO's iteration granularity).

With async scheduling (on CUDA by default) the three calls of consecutive steps overlap: step N+1
is scheduled and launched while the GPU still runs step N, and N's results are applied while the
GPU runs N+1. The host's Python (scheduling, input staging, result handling) then hides behind
the device's work instead of adding to it; outputs come back one `step()` later.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fedllm_contract.cache_events import CacheEvent
from site_engine.engine.api import (
    EngineLimits,
    EngineRequest,
    EngineStats,
    RequestOutput,
    RequestRejected,
)
from site_engine.engine.kv_cache import KVCacheSpec, kv_cache_bytes_per_block
from site_engine.engine.launched_step import LaunchedStep
from site_engine.engine.model_runner import ModelRunner
from site_engine.engine.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from site_engine.engine.scheduling_policy import PolicyName
from site_engine.engine.sequence import Sequence
from site_engine.engine.types import FinishReason, SchedulerOutput
from site_engine.model_loading import LoadedModel

MIB = 1 << 20
# On CPU without an explicit budget: room for this many full-length sequences.
_CPU_DEFAULT_FULL_SEQUENCES = 4
# On CUDA without an explicit budget: what is free after the weights and a trial forward pass at
# the largest step, less this share of the device kept for the allocator, graphs and sampling.
_CUDA_SAFETY_SHARE = 0.08


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    # KV cache budget in bytes; 0 chooses one from the device (see kv_cache_blocks).
    kv_cache_bytes: int = 0
    policy: PolicyName = "fcfs"
    # CUDA only: replay decode steps of up to max_num_seqs sequences from CUDA graphs, and steps
    # with prefill chunks (up to max_num_batched_tokens tokens) from flat step graphs.
    cuda_graphs: bool = True
    # Schedule step N+1 while step N runs. None: on for CUDA, off elsewhere (a CPU step does its
    # work before returning, so there is nothing to overlap; True still works there, for tests).
    async_scheduling: bool | None = None
    # Automatic prefix caching (site_engine/engine/block_manager.py); block ids are seeded by
    # `model_name`, the name the gateway routes by, so that it computes the same ids.
    prefix_caching: bool = True
    model_name: str = ""
    # Bytes of host memory for the prefix cache's second tier (0: none; needs prefix_caching).
    host_kv_cache_bytes: int = 0


def kv_cache_blocks(loaded: LoadedModel, config: EngineConfig) -> int:
    """Blocks for the configured budget, or a device-derived default."""
    spec = KVCacheSpec.from_config(loaded.model.config)
    per_block = kv_cache_bytes_per_block(spec, config.block_size, loaded.dtype)
    if config.kv_cache_bytes > 0:
        budget = config.kv_cache_bytes
    elif loaded.device.type == "cuda":
        budget = _cuda_kv_budget(loaded, config)
    else:
        full = -(-loaded.max_model_len // config.block_size)
        return full * min(config.max_num_seqs, _CPU_DEFAULT_FULL_SEQUENCES)
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(
            f"a KV budget of {budget / MIB:.1f} MiB holds no block of {per_block} bytes"
        )
    return int(blocks)


@torch.inference_mode()
def _cuda_kv_budget(loaded: LoadedModel, config: EngineConfig) -> int:
    """Free memory after a trial forward of the largest step, minus a safety share.

    The trial runs the transformers model on max_num_batched_tokens tokens (its activations are
    at least ours) and adds the float32 logits of a full decode batch, so a step at the maximum
    batch cannot run out of memory once the cache has taken the rest.
    """
    device = loaded.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    tokens = min(config.max_num_batched_tokens, loaded.max_model_len)
    trial = torch.zeros((1, tokens), dtype=torch.long, device=device)
    loaded.model(input_ids=trial, use_cache=False, logits_to_keep=1)
    activations = torch.cuda.max_memory_allocated(device) - before
    logits = config.max_num_seqs * loaded.vocab_size * 4 * 2  # logits and their softmax
    del trial
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return int(free - activations - logits - total * _CUDA_SAFETY_SHARE)


class PagedEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        num_blocks = kv_cache_blocks(loaded, config)
        block_bytes = kv_cache_bytes_per_block(
            KVCacheSpec.from_config(loaded.model.config), config.block_size, loaded.dtype
        )
        host_blocks = config.host_kv_cache_bytes // block_bytes
        if config.host_kv_cache_bytes and not (config.prefix_caching and host_blocks):
            raise ValueError(
                f"a host KV tier of {config.host_kv_cache_bytes} bytes needs prefix caching and "
                f"room for at least one block of {block_bytes} bytes"
            )
        self._runner = ModelRunner(
            loaded.model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            device=loaded.device,
            dtype=loaded.dtype,
            cuda_graph_max_batch=config.max_num_seqs if config.cuda_graphs else 0,
            cuda_graph_max_tokens=config.max_num_batched_tokens if config.cuda_graphs else 0,
            host_kv_slots=host_blocks,
        )
        self._scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=num_blocks,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=loaded.max_model_len,
                policy=config.policy,
                eos_token_ids=loaded.eos_token_ids,
                prefix_caching=config.prefix_caching,
                model_name=config.model_name,
                host_kv_blocks=host_blocks,
            )
        )
        self._limits = EngineLimits(
            max_model_len=loaded.max_model_len,
            kv_block_size=config.block_size,
            kv_blocks_total=num_blocks,
            max_num_seqs=config.max_num_seqs,
            name=f"paged-{config.policy}",
            prefix_caching=config.prefix_caching,
            host_kv_blocks=host_blocks,
            kv_block_bytes=block_bytes,
        )
        overlap = config.async_scheduling
        self._async = loaded.device.type == "cuda" if overlap is None else overlap
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    @property
    def runner(self) -> ModelRunner:
        return self._runner

    def add_request(self, request: EngineRequest) -> None:
        try:
            self._scheduler.add(
                request.request_id,
                request.prompt_token_ids,
                request.sampling,
                request.predicted_tokens,
                request.cache_salt,
            )
        except ValueError as exc:
            raise RequestRejected(str(exc)) from exc

    def abort(self, request_id: str, reason: FinishReason) -> bool:
        return self._scheduler.finish(request_id, reason)

    def release_queued(self, max_requests: int) -> list[EngineRequest]:
        return [_as_request(seq) for seq in self._scheduler.release_queued(max_requests)]

    def has_unfinished(self) -> bool:
        return self._scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step; return the outputs of the step that completed: this one
        (synchronous), or the one launched by the previous call (async scheduling)."""
        try:
            scheduled = self._scheduler.schedule()
            previous = self._in_flight
            launched = self._runner.launch(scheduled, previous[1] if previous else None)
            self._in_flight = (scheduled, launched)
            outputs = self._apply(*previous) if previous is not None else []
            if not self._async or scheduled.is_empty:
                # An empty step has nothing to overlap with; applying it now lets the loop end.
                outputs += self._apply(scheduled, launched)
                self._in_flight = None
        except Exception:
            # A failed step may have left cached blocks half written: none may be shared again.
            self._scheduler.clear_prefix_cache()
            raise
        return outputs

    def _apply(self, scheduled: SchedulerOutput, launched: LaunchedStep) -> list[RequestOutput]:
        updates = self._scheduler.update(scheduled, launched.result())
        return [
            RequestOutput(u.request_id, u.new_token_ids, u.finish_reason, u.cached_prompt_tokens)
            for u in updates
        ]

    def restart_scheduler(self, *, prefix_caching: bool, host_tier: bool) -> None:
        """An idle engine starts over with an empty scheduler and cache index on the same runner
        (its CUDA graphs stay captured): a benchmark's arms with caching off, on, and with the
        host tier (if the runner has one) compare on one warmed-up engine."""
        if self.has_unfinished():
            raise RuntimeError("restart_scheduler needs an idle engine")
        host_blocks = self._runner.host_kv.num_slots if host_tier and self._runner.host_kv else 0
        if host_tier and not host_blocks:
            raise ValueError("this engine was built without a host KV tier")
        config = replace(
            self._scheduler.config,
            prefix_caching=prefix_caching,
            host_kv_blocks=host_blocks if prefix_caching else 0,
        )
        self._scheduler = Scheduler(config)
        self._limits = replace(
            self._limits, prefix_caching=prefix_caching, host_kv_blocks=config.host_kv_blocks
        )

    def take_cache_events(self) -> list[CacheEvent]:
        return self._scheduler.take_cache_events()

    def cache_snapshot(self) -> list[CacheEvent]:
        return self._scheduler.cache_snapshot()

    def queue_lengths(self) -> tuple[int, int]:
        """(waiting, running) requests, cheap enough to read after every step."""
        return self._scheduler.queue_lengths()

    def scheduler_stats(self) -> SchedulerStats:
        return self._scheduler.stats()

    def stats(self) -> EngineStats:
        stats = self._scheduler.stats()
        return EngineStats(
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            queued_prompt_tokens=stats.queued_prompt_tokens,
            running_tokens=stats.cached_tokens,
            predicted_remaining_tokens=stats.predicted_remaining_tokens,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            iterations=stats.iterations,
            num_preemptions=stats.num_preemptions,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            prefix_cache_host_hits=stats.prefix_cache_host_hits,
            prompt_tokens_computed=stats.prompt_tokens_computed,
            kv_blocks_cached=stats.kv_blocks_cached,
            host_kv_bytes_offloaded=stats.host_kv_blocks_offloaded * self._limits.kv_block_bytes,
            host_kv_bytes_onloaded=stats.host_kv_blocks_onloaded * self._limits.kv_block_bytes,
        )


def _as_request(seq: Sequence) -> EngineRequest:
    return EngineRequest(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        sampling=seq.sampling,
        predicted_tokens=seq.predicted_tokens,
        cache_salt=seq.cache_salt,
    )
