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

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fedllm_contract.grammar import UnenforceableConstraint
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

if TYPE_CHECKING:
    from site_engine.engine.structured_output import GrammarCompiler
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
        self._runner = ModelRunner(
            loaded.model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            device=loaded.device,
            dtype=loaded.dtype,
            cuda_graph_max_batch=config.max_num_seqs if config.cuda_graphs else 0,
            cuda_graph_max_tokens=config.max_num_batched_tokens if config.cuda_graphs else 0,
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
            )
        )
        self._limits = EngineLimits(
            max_model_len=loaded.max_model_len,
            kv_block_size=config.block_size,
            kv_blocks_total=num_blocks,
            max_num_seqs=config.max_num_seqs,
            name=f"paged-{config.policy}",
        )
        self._loaded = loaded
        self._grammars: GrammarCompiler | None = None
        overlap = config.async_scheduling
        self._async = loaded.device.type == "cuda" if overlap is None else overlap
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    @property
    def runner(self) -> ModelRunner:
        return self._runner

    def grammars(self) -> GrammarCompiler:
        """The compiler of constrained requests' grammars, built on first use (it reads the
        whole vocabulary once, ~1.5 s for SmolLM2's); a site warms it at start-up."""
        if self._grammars is None:
            # Imported on first use: llguidance is needed only where constraints are served.
            from site_engine.engine.structured_output import GrammarCompiler

            self._grammars = GrammarCompiler(
                self._loaded.tokenizer, self._runner.vocab_size, self._loaded.eos_token_ids
            )
        return self._grammars

    def add_request(self, request: EngineRequest) -> None:
        constraint = request.sampling.constraint
        try:
            guide = self.grammars().guide(constraint) if constraint is not None else None
        except UnenforceableConstraint as exc:
            raise RequestRejected(f"the answer's constraint cannot be enforced: {exc}") from exc
        before = request.sampling.generated_before
        if guide is not None and before:
            # A continuation: the answer so far ends the prompt; its grammar goes on from there.
            earlier = request.prompt_token_ids[-before:]
            if before > len(request.prompt_token_ids) or not all(map(guide.consume, earlier)):
                raise RequestRejected("the answer so far does not follow its constraint")
        try:
            self._scheduler.add(
                request.request_id,
                request.prompt_token_ids,
                request.sampling,
                request.predicted_tokens,
                guide=guide,
                releasable=request.releasable,
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
        scheduled = self._scheduler.schedule()
        previous = self._in_flight
        step = self._runner.launch_logits(scheduled, previous[1] if previous else None)
        outputs: list[RequestOutput] = []
        if previous is not None and step.reads_host_state:
            # Constrained or penalized rows sample from what the previous step's tokens make of
            # their grammar and history: that step is applied first, while the device runs this
            # step's model. Steps without such rows never wait here (see _apply's docstring).
            outputs = self._apply(*previous)
            previous = None
        launched = self._runner.sample(step)
        self._in_flight = (scheduled, launched)
        if previous is not None:
            outputs = self._apply(*previous)
        if not self._async or scheduled.is_empty:
            # An empty step has nothing to overlap with; applying it now lets the loop end.
            outputs += self._apply(scheduled, launched)
            self._in_flight = None
        return outputs

    def _apply(self, scheduled: SchedulerOutput, launched: LaunchedStep) -> list[RequestOutput]:
        """Applies a step's tokens (the scheduler's update advances grammars and histories).

        With async scheduling a step N+1 with constrained or penalized rows needs step N's
        tokens on the host before it samples: its model work is queued first, then N is
        applied (the host waits for N's tokens while the device runs N+1's forward), then
        N+1's masks are computed and its sampling queued. The device idles only for the mask
        computation (microseconds per row, bench/results/grammar_engines.md) and only in steps
        that hold such rows; steps without them overlap fully, as before.
        """
        result = launched.result()
        updates = self._scheduler.update(scheduled, result)
        return [
            RequestOutput(
                u.request_id,
                u.new_token_ids,
                u.finish_reason,
                result.logprobs.get(u.request_id),
            )
            for u in updates
        ]

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
        )


def _as_request(seq: Sequence) -> EngineRequest:
    return EngineRequest(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        sampling=seq.sampling,
        predicted_tokens=seq.predicted_tokens,
    )
