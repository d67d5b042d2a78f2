"""The site's engine: iteration-level scheduling over a paged KV cache.

One step is three calls: the scheduler decides (core/, numpy and Python, no torch), the model
runner computes (model_runner.py), the scheduler takes the results. Finished sequences leave and
waiting ones enter at the very next step (MICO's iteration granularity).

With async scheduling (on CUDA by default) the three calls of consecutive steps overlap: step N+1
is scheduled and launched while the GPU still runs step N, and N's results are applied while the
GPU runs N+1. The host's work (scheduling, input staging, result handling) then hides behind
the device's instead of adding to it; outputs come back one `step()` later.

This class is the step loop and the façade the site drives; each concern beside the loop has a
component of its own, with one owner each: the constrained requests' grammars (grammar_feed.py),
the LoRA adapters (adapter_feed.py), the KV cache lent to a neighbour or to fine-tuning
(kv_lender.py) and the CUDA graphs captured while serving (lazy_graphs.py); what the engine is
built with and how much cache it gets is engine_config.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from fedllm_contract.cache_events import CacheEvent
from site_engine.engine.adapter_feed import AdapterFeed
from site_engine.engine.core.api import (
    EngineLimits,
    EngineRequest,
    EngineStats,
    RequestRejected,
    StepOutputs,
)
from site_engine.engine.core.graph_capture import CapturePolicy, GraphCaptureQueue
from site_engine.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from site_engine.engine.core.sequence import Sequence
from site_engine.engine.core.step_cost import StepCost
from site_engine.engine.core.types import FinishReason, ModelRunnerOutput, SchedulerOutput
from site_engine.engine.engine_config import EngineConfig, kv_cache_blocks, offload_limits, plan_kv
from site_engine.engine.grammar_feed import GrammarFeed, follow_answer_so_far
from site_engine.engine.kv_lender import KvLender
from site_engine.engine.launched_step import LaunchedStep
from site_engine.engine.lazy_graphs import LazyGraphs
from site_engine.engine.logit_processing import GrammarMasks
from site_engine.engine.lora.adapter import BaseShapes
from site_engine.engine.lora.registry import AdapterRegistry, unified_adapter_blocks
from site_engine.engine.memory_plan import GIB, KvPlan, startup_report
from site_engine.engine.model_runner import ModelRunner

if TYPE_CHECKING:
    from site_engine.engine.grammar_compiler import GrammarCompiler
from site_engine.model_loading import LoadedModel

__all__ = ["EngineConfig", "PagedEngine", "kv_cache_blocks", "plan_kv"]

# With nothing to step but requests waiting for their grammars or adapters, a step waits this
# long at most for one (the engine's commands, an abort say, are taken between steps).
_GRAMMAR_WAIT_S = 0.01


class PagedEngine:
    def __init__(
        self, loaded: LoadedModel, config: EngineConfig, plan: KvPlan | None = None
    ) -> None:
        # A plan recorded earlier for this card, model and settings (a pooled start,
        # site_engine/pool.py) spares the memory trial.
        plan = plan if plan is not None else plan_kv(loaded, config)
        block_bytes = plan.bytes_per_block
        host_blocks = config.host_kv_cache_bytes // block_bytes
        if config.host_kv_cache_bytes and not (config.prefix_caching and host_blocks):
            raise ValueError(
                f"a host KV tier of {config.host_kv_cache_bytes} bytes needs prefix caching and "
                f"room for at least one block of {block_bytes} bytes"
            )
        before = _device_memory(loaded.device)
        registry = (
            AdapterRegistry(
                config.lora, BaseShapes.of_model(loaded.model), loaded.dtype, loaded.device
            )
            if config.lora is not None
            else None
        )
        self._adapters = AdapterFeed(registry)
        self._runner = ModelRunner(
            loaded.model,
            num_blocks=plan.num_blocks,
            block_size=config.block_size,
            device=loaded.device,
            dtype=loaded.dtype,
            cuda_graph_max_batch=config.max_num_seqs if config.cuda_graphs else 0,
            cuda_graph_max_tokens=config.max_num_batched_tokens if config.cuda_graphs else 0,
            host_kv_slots=host_blocks,
            adapters=registry,
            lazy_graphs=config.lazy_graphs,
            max_rows=config.max_num_seqs,
        )
        pace = CapturePolicy(config.graph_capture_every_steps, config.graph_capture_idle_s)
        self._graphs = LazyGraphs(self._runner, pace)
        self._scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=plan.num_blocks,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=loaded.max_model_len,
                policy=config.policy,
                eos_token_ids=loaded.eos_token_ids,
                prefix_caching=config.prefix_caching,
                model_name=config.model_name,
                host_kv_blocks=host_blocks,
                host_offload=offload_limits(config, block_bytes),
                background_step_tokens=config.background_step_tokens,
                background_step_slack=config.background_step_slack,
                max_loras=config.lora.max_loras if config.lora else 0,
                adapter_blocks=unified_adapter_blocks(
                    config.lora, loaded.model, loaded.dtype, block_bytes
                ),
            )
        )
        self._lender = KvLender(
            plan, lambda blocks: self._graphs.resized(lambda: self._runner.resize_kv(blocks))
        )
        self._limits = EngineLimits(
            max_model_len=loaded.max_model_len,
            kv_block_size=config.block_size,
            kv_blocks_total=plan.num_blocks,
            max_num_seqs=config.max_num_seqs,
            name=f"paged-{config.policy}",
            prefix_caching=config.prefix_caching,
            host_kv_blocks=host_blocks,
            kv_block_bytes=block_bytes,
        )
        self._grammars = GrammarFeed(
            loaded.tokenizer,
            self._runner.vocab_size,
            loaded.eos_token_ids,
            threads=config.grammar_compile_threads,
            timeout_s=config.grammar_compile_timeout_s,
        )
        overlap = config.async_scheduling
        self._async = loaded.device.type == "cuda" if overlap is None else overlap
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        self._graphs_note = self._describe_graphs(before, _device_memory(loaded.device))
        self._closed = False
        self._measure_steps = config.measure_step_time
        self._applied_work: tuple[int, int] | None = None

    # ---- what the engine is --------------------------------------------------------------------
    def _describe_graphs(self, before: tuple[int, int], after: tuple[int, int]) -> str:
        count = self._runner.num_graphs
        if not count and not self._graphs.done:
            pending = len(self._graphs.queue.remaining)
            return f"{pending} CUDA graphs to capture between steps while serving (lazy graphs)"
        if not count:
            return "no CUDA graphs"
        reserved = after[0] - before[0] - self._runner.kv_cache.num_bytes
        driver = (after[1] - after[0]) - (before[1] - before[0])
        return (
            f"{count} CUDA graphs captured, {reserved / GIB:.2f} GiB in torch's pools and "
            f"buffers + {max(driver, 0) / GIB:.2f} GiB outside them"
        )

    @property
    def kv_plan(self) -> KvPlan:
        return self._lender.plan

    @property
    def token_budget(self) -> int:
        """The most tokens one step schedules (max_num_batched_tokens)."""
        return self._scheduler.config.max_num_batched_tokens

    @property
    def startup_report(self) -> str:
        """One line: the KV cache (blocks, tokens, GiB, full-length sequences that fit), the
        graphs and their memory, where the device's memory went, and the prefix cache."""
        limits = self._limits
        if not limits.prefix_caching:
            cache = "prefix caching off"
        elif limits.host_kv_blocks:
            host_gib = limits.host_kv_blocks * limits.kv_block_bytes / (1 << 30)
            blocks = limits.host_kv_blocks
            cache = f"prefix caching on, host tier {blocks:,} blocks ({host_gib:.2f} GiB)"
        else:
            cache = "prefix caching on, no host tier"
        attention = self._runner.attention.describe()
        return f"{startup_report(self.kv_plan, self._graphs_note)}; {cache}; {attention}"

    def close(self) -> None:
        """Frees the KV cache and the CUDA graphs now, so that another engine in this process
        finds the device as this one found it. The engine cannot step afterwards."""
        if self._closed:
            return
        self._closed = True
        self._in_flight = None
        self._graphs.close()
        self._grammars.close()
        self._adapters.close()
        self._runner.close()
        if self._runner.device.type == "cuda":
            from site_engine.engine.memory_trial import release_unreachable

            release_unreachable(self._runner.device)

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    @property
    def runner(self) -> ModelRunner:
        return self._runner

    # ---- requests ------------------------------------------------------------------------------
    def adopt_grammars(self, compiler: GrammarCompiler) -> bool:
        """A compiler built before the engine (a pooled site builds it while it waits: it reads
        only the tokenizer); refused (False) unless it masks this engine's logits width."""
        return self._grammars.adopt(compiler)

    def grammars(self) -> GrammarCompiler:
        """The compiler of constrained requests' grammars, built on first use."""
        return self._grammars.compiler()

    def add_request(self, request: EngineRequest) -> None:
        """Queues a request. A constrained one whose grammar is not compiled yet waits for it
        in the queue (its compile runs off this thread): a failed compile ends it later, with
        FinishReason.ERROR, where a cached grammar's failures are refused here."""
        constraint = request.sampling.constraint
        guide = self._grammars.cached(constraint) if constraint is not None else None
        adapter = request.adapter or ""
        adapter_resident = self._adapters.request(adapter)
        if guide is not None:
            follow_answer_so_far(guide, request.prompt_token_ids, request.sampling)
        try:
            self._scheduler.add(
                request.request_id,
                request.prompt_token_ids,
                request.sampling,
                request.predicted_tokens,
                cache_salt=request.cache_salt,
                guide=guide,
                releasable=request.releasable,
                awaiting_guide=constraint is not None and guide is None,
                priority=request.priority,
                adapter=adapter,
                awaiting_adapter=not adapter_resident,
            )
        except ValueError as exc:
            raise RequestRejected(str(exc)) from exc
        if constraint is not None and guide is None:
            self._grammars.await_compile(request.request_id, constraint)

    def served_adapters(self) -> tuple[str, ...]:
        """The LoRA adapters requests may name (EngineRequest.adapter), sorted; () if none."""
        return self._adapters.served()

    def load_adapter(self, name: str, path: str) -> None:
        """Any thread: the registry checks the files and links them in under its own lock."""
        self._adapters.load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Engine thread; refused while requests of `name` are live (AdapterFeed.unload)."""
        self._adapters.unload(name, self._scheduler)

    @property
    def adapters(self) -> AdapterRegistry | None:
        return self._adapters.registry

    def abort(self, request_id: str, reason: FinishReason) -> bool:
        self._grammars.drop(request_id)
        return self._scheduler.finish(request_id, reason)

    def release_queued(self, max_requests: int) -> list[EngineRequest]:
        # Never one waiting for its grammar (Scheduler.release_queued).
        return [_as_request(seq) for seq in self._scheduler.release_queued(max_requests)]

    def has_unfinished(self) -> bool:
        return self._scheduler.has_unfinished() or self._in_flight is not None

    # ---- the step loop -------------------------------------------------------------------------
    def step(self) -> StepOutputs:
        """Schedule and launch a step; return the outputs of the step that completed: this one
        (synchronous), or the one launched by the previous call (async scheduling)."""
        if self._closed:
            raise RuntimeError("the engine was closed")
        began = time.perf_counter()
        try:
            outputs = self._step()
        except Exception:
            # A failed step may have left cached blocks half written: none may be shared again.
            self._scheduler.clear_prefix_cache()
            raise
        if self._measure_steps:
            self.record_step_seconds(time.perf_counter() - began)
        if self._graphs.due_after_step():
            outputs.extend(self._drain())
            self._graphs.capture(busy=True)
        return outputs

    def _step(self) -> StepOutputs:
        failed = self._grammars.settle(self._scheduler)
        failed.extend(self._adapters.settle(self._scheduler))
        scheduled = self._scheduler.schedule()
        idle = scheduled.is_empty and not scheduled.kv_copies  # copies back: a step follows
        if idle and self._in_flight is None and not failed:
            # Nothing to run but requests waiting for their grammars or adapters: wait for one
            # (briefly).
            if self._grammars:
                self._grammars.wait(_GRAMMAR_WAIT_S)
            else:
                self._adapters.wait(_GRAMMAR_WAIT_S)
        failed.extend(self._run_step(scheduled))
        return failed

    def _run_step(self, scheduled: SchedulerOutput) -> StepOutputs:
        previous = self._in_flight
        step = self._runner.launch_logits(scheduled)
        outputs = StepOutputs()
        masks: GrammarMasks | None = None
        if previous is not None and step.reads_host_state:
            # Constrained or penalized rows sample from what the previous step's tokens make of
            # their grammar and history, while the device runs this step's model (see _apply's
            # docstring): the previous step is applied before this one samples. Grammars are
            # advanced first, and their masks fill on the sampler's thread while this thread
            # applies the rest of that update.
            known = previous[1].result()
            if not step.reads_history:
                self._scheduler.advance_guides(previous[0], known)
                masks = self._runner.prepare_masks(step, background=True)
            try:
                outputs = self._apply(*previous, known)
            except BaseException:
                if masks is not None:
                    masks.ready()  # the filler is free again for the steps after this failure
                raise
            previous = None
        launched = self._runner.sample(step, masks)
        self._in_flight = (scheduled, launched)
        if previous is not None:
            outputs = self._apply(*previous)
        if not self._async or scheduled.is_empty:
            # An empty step has nothing to overlap with; applying it now lets the loop end.
            outputs.extend(self._apply(scheduled, launched))
            self._in_flight = None
        return outputs

    def _apply(
        self,
        scheduled: SchedulerOutput,
        launched: LaunchedStep,
        known: ModelRunnerOutput | None = None,
    ) -> StepOutputs:
        """Applies a step's tokens (the scheduler's update advances grammars and histories).

        With async scheduling a step N+1 with constrained or penalized rows needs step N's
        tokens on the host before it samples: its model work is queued first, then the host
        waits for N's tokens (the device runs N+1's forward meanwhile) and applies N, then
        N+1's sampling is queued. Grammars are advanced first (Scheduler.advance_guides), so
        that N+1's masks fill on another thread (llguidance, without the GIL) while N's update
        runs here. Steps without such rows overlap fully: N is applied after N+1's sampling.
        """
        if known is None:
            known = launched.result()
        if scheduled.num_tokens:
            self._applied_work = (scheduled.num_tokens, scheduled.context_tokens)
        outputs = self._scheduler.update(scheduled, known)
        if known.logprobs:
            index = {rid: i for i, rid in enumerate(outputs.request_ids) if rid in known.logprobs}
            for request_id, logprob in known.logprobs.items():
                at = index.get(request_id)
                if at is not None:
                    outputs.logprobs[at] = logprob
        return outputs

    def record_step_seconds(self, seconds: float) -> None:
        """The last step() took `seconds`: charged to the step whose tokens it applied (with
        async scheduling it waited for that step's results), for the learned step cost."""
        applied, self._applied_work = self._applied_work, None
        if applied is not None:
            self._scheduler.observe_step(applied[0], applied[1], seconds)

    @property
    def step_in_flight(self) -> bool:
        """Whether a launched step's results are not applied yet (async scheduling)."""
        return self._in_flight is not None

    # ---- lazy graphs ---------------------------------------------------------------------------
    @property
    def graph_queue(self) -> GraphCaptureQueue:
        return self._graphs.queue

    @property
    def on_graphs_ready(self) -> Callable[[float], None] | None:
        return self._graphs.on_ready

    @on_graphs_ready.setter
    def on_graphs_ready(self, callback: Callable[[float], None] | None) -> None:
        self._graphs.on_ready = callback

    @property
    def graphs_pending(self) -> bool:
        """Lazy graphs: whether some remain to be captured."""
        return not self._graphs.done

    def capture_idle_graphs(self) -> int:
        """Lazy graphs, while nothing runs: captures a time-bounded run of the pending graphs
        (CapturePolicy.idle_budget_s); returns how many. The engine thread calls it."""
        if self.has_unfinished() or self._closed:
            return 0
        return self._graphs.capture(busy=False)

    def _drain(self) -> StepOutputs:
        """Applies the step in flight now (it gives up its overlap with the next one), so that
        no step of ours is queued on the device while a graph is captured."""
        if self._in_flight is None:
            return StepOutputs()
        scheduled, launched = self._in_flight
        self._in_flight = None
        outputs = self._apply(scheduled, launched)
        self._applied_work = None  # the next step() times no step of its own for it
        return outputs

    # ---- idle memory: the KV cache lent -------------------------------------------------------
    def kv_room(self) -> int:
        """Bytes `lend_kv` could lend now (0 while lending). Engine thread."""
        return self._lender.room(self._scheduler.block_manager)

    def lend_kv(self, wanted_bytes: int) -> int:
        """Engine thread. Lends the free top of the cache covering `wanted_bytes` and releases
        its memory (KvLender.lend): the bytes lent, 0 if refused."""
        self._scheduler.evict_idle_adapters()  # unified slots: the top may hold an idle one
        lent = self._lender.lend(self._scheduler.block_manager, wanted_bytes)
        self._planned_limits()
        return lent

    def reserve_kv(self, wanted_bytes: int) -> bool:
        """Engine thread. The site's own fine-tuning takes `wanted_bytes` from the top of the
        cache while a job trains (EngineConfig.finetune_reserve_on_demand, KvLender.reserve)."""
        self._scheduler.evict_idle_adapters()
        held = self._lender.reserve(self._scheduler.block_manager, wanted_bytes)
        self._planned_limits()
        return held

    def release_kv_reserve(self) -> int:
        """Engine thread. No job trains: the reserve is the cache's again; the bytes."""
        returned = self._lender.release_reserve(self._scheduler.block_manager)
        self._planned_limits()
        return returned

    def return_kv(self) -> int:
        """Engine thread. The neighbour left: the cache grows back; the bytes returned (0:
        nothing was lent). Raises if the memory cannot be had again (the blocks stay lent)."""
        returned = self._lender.give_back(self._scheduler.block_manager)
        self._planned_limits()
        return returned

    def _planned_limits(self) -> None:
        self._limits = replace(self._limits, kv_blocks_total=self._lender.plan.num_blocks)

    # ---- the scheduler's state -----------------------------------------------------------------
    def restart_scheduler(self, *, prefix_caching: bool, host_tier: bool) -> None:
        """An idle engine starts over with an empty scheduler and cache index on the same runner
        (its CUDA graphs stay captured): a benchmark's arms with caching off, on, and with the
        host tier (if the runner has one) compare on one warmed-up engine."""
        if self.has_unfinished() or self._lender.lending is not None:
            raise RuntimeError("restart_scheduler needs an idle engine that lends nothing")
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

    def clear_prefix_cache(self) -> None:
        """An idle engine forgets every cached block (the blocks stay, unindexed): a benchmark's
        arms that replay the same prompts each start from the same cold cache, rather than the
        second finding the first one's prompts cached (bench/engine/priority_driver.py)."""
        if self.has_unfinished():
            raise RuntimeError("clear_prefix_cache needs an idle engine")
        self._scheduler.clear_prefix_cache()

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
        lora = self._adapters.residency()
        block_bytes = self._limits.kv_block_bytes
        return EngineStats(
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            queued_prompt_tokens=stats.queued_prompt_tokens,
            running_tokens=stats.cached_tokens,
            predicted_remaining_tokens=stats.predicted_remaining_tokens,
            kv_blocks_used=stats.kv_blocks_used,
            # Lent blocks are the neighbour's memory now (idle memory first).
            kv_blocks_total=stats.kv_blocks_total - self._scheduler.block_manager.num_lent_blocks,
            iterations=stats.iterations,
            num_preemptions=stats.num_preemptions,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            prefix_cache_host_hits=stats.prefix_cache_host_hits,
            prompt_tokens_computed=stats.prompt_tokens_computed,
            kv_blocks_cached=stats.kv_blocks_cached,
            host_kv_bytes_offloaded=stats.host_kv_blocks_offloaded * block_bytes,
            host_kv_bytes_onloaded=stats.host_kv_blocks_onloaded * block_bytes,
            host_kv_blocks_skipped_budget=stats.host_kv_blocks_skipped_budget,
            host_kv_blocks_declined=stats.host_kv_blocks_declined,
            by_class=stats.by_class,
            adapters_on_device=lora.on_device,
            adapters_in_host=lora.in_host,
            adapter_load_s=lora.load_s,
            adapter_loads=lora.loads,
            adapter_load_failures=lora.load_failures,
            adapter_waits=lora.waits,
            adapter_wait_s=lora.wait_s,
            step_cost_s=_terms(self._scheduler.step_cost),
        )


def _terms(cost: StepCost | None) -> tuple[float, ...]:
    return () if cost is None else (cost.base_s, cost.per_token_s, cost.per_context_s)


def _device_memory(device: torch.device) -> tuple[int, int]:
    """(bytes torch has reserved, bytes in use on the device), or zeros off CUDA."""
    if device.type != "cuda":
        return 0, 0
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return torch.cuda.memory_reserved(device), total - free


def _as_request(seq: Sequence) -> EngineRequest:
    return EngineRequest(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        sampling=seq.sampling,
        predicted_tokens=seq.predicted_tokens,
        cache_salt=seq.cache_salt,
        priority=seq.priority,
        adapter=seq.adapter or None,
    )
