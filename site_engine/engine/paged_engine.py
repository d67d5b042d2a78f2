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

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fedllm_contract.cache_events import CacheEvent
from site_engine.engine.core.api import (
    AdapterRefused,
    EngineLimits,
    EngineRequest,
    EngineStats,
    RequestRejected,
    StepOutputs,
    StructuredOutputUnavailable,
)
from site_engine.engine.core.graph_capture import CapturePolicy, GraphCaptureQueue
from site_engine.engine.core.host_offload import OffloadLimits
from site_engine.engine.core.kv_lending import Lending, lend, lendable_bytes, take_back
from site_engine.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from site_engine.engine.core.scheduling_policy import PolicyName
from site_engine.engine.core.sequence import Sequence
from site_engine.engine.core.step_cost import StepCost
from site_engine.engine.core.types import (
    FinishReason,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from site_engine.engine.kv_cache import KVCacheSpec, kv_cache_bytes_per_block
from site_engine.engine.launched_step import LaunchedStep
from site_engine.engine.logit_processing import GrammarMasks
from site_engine.engine.lora.adapter import AdapterError, BaseShapes
from site_engine.engine.lora.registry import (
    AdapterRegistry,
    AdapterResidency,
    LoraSettings,
    lora_slot_bytes,
)
from site_engine.engine.memory_plan import (
    GIB,
    KvPlan,
    blocks_for,
    plan_from_budget,
    plan_kv_cache,
    startup_report,
)
from site_engine.engine.model_runner import ModelRunner

if TYPE_CHECKING:
    from site_engine.engine.core.types import Guide
    from site_engine.engine.grammar_compiler import GrammarCompiler, GrammarWaits
from site_engine.model_loading import LoadedModel

log = logging.getLogger(__name__)

MIB = 1 << 20
# With nothing to step but requests waiting for their grammars, a step waits this long at most
# for a compile to finish (the engine's commands, an abort say, are taken between steps).
_GRAMMAR_WAIT_S = 0.01
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


class PagedEngine:
    def __init__(
        self, loaded: LoadedModel, config: EngineConfig, plan: KvPlan | None = None
    ) -> None:
        # A plan recorded earlier for this card, model and settings (a pooled start,
        # site_engine/pool.py) spares the memory trial.
        self._plan = plan if plan is not None else plan_kv(loaded, config)
        num_blocks = self._plan.num_blocks
        block_bytes = self._plan.bytes_per_block
        host_blocks = config.host_kv_cache_bytes // block_bytes
        if config.host_kv_cache_bytes and not (config.prefix_caching and host_blocks):
            raise ValueError(
                f"a host KV tier of {config.host_kv_cache_bytes} bytes needs prefix caching and "
                f"room for at least one block of {block_bytes} bytes"
            )
        before = _device_memory(loaded.device)
        self._adapters = _adapter_registry(loaded, config.lora)
        self._runner = ModelRunner(
            loaded.model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            device=loaded.device,
            dtype=loaded.dtype,
            cuda_graph_max_batch=config.max_num_seqs if config.cuda_graphs else 0,
            cuda_graph_max_tokens=config.max_num_batched_tokens if config.cuda_graphs else 0,
            host_kv_slots=host_blocks,
            adapters=self._adapters,
            lazy_graphs=config.lazy_graphs,
            max_rows=config.max_num_seqs,
        )
        # Lazy graphs: what remains to capture (empty otherwise); who hears of the last one.
        self._pace = CapturePolicy(config.graph_capture_every_steps, config.graph_capture_idle_s)
        self.graph_queue = GraphCaptureQueue(self._runner.pending_graphs(), self._pace)
        self.on_graphs_ready: Callable[[float], None] | None = None
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
                host_offload=_offload_limits(config, block_bytes),
                background_step_tokens=config.background_step_tokens,
                background_step_slack=config.background_step_slack,
                max_loras=config.lora.max_loras if config.lora else 0,
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
        self._loaded = loaded
        self._config = config
        self._grammars: GrammarCompiler | None = None
        # Requests whose grammar is compiling (they wait in the scheduler's queue).
        self._waits: GrammarWaits | None = None
        overlap = config.async_scheduling
        self._async = loaded.device.type == "cuda" if overlap is None else overlap
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        self._graphs_note = self._describe_graphs(before, _device_memory(loaded.device))
        self._closed = False
        self._measure_steps = config.measure_step_time
        self._applied_work: tuple[int, int] | None = None
        # The top of the cache lent to a neighbour instance (idle memory first), or None.
        self._lending: Lending | None = None
        self._reserved = False  # the lending is the trainer's reserve (reserve_kv)

    def _describe_graphs(self, before: tuple[int, int], after: tuple[int, int]) -> str:
        count = self._runner.num_graphs
        if not count and not self.graph_queue.done:
            pending = len(self.graph_queue.remaining)
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
        return self._plan

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
        return f"{startup_report(self._plan, self._graphs_note)}; {cache}; {attention}"

    def close(self) -> None:
        """Frees the KV cache and the CUDA graphs now, so that another engine in this process
        finds the device as this one found it. The engine cannot step afterwards."""
        if self._closed:
            return
        self._closed = True
        self._in_flight = None
        self.graph_queue = GraphCaptureQueue()  # its callables capture into the runner's sets
        if self._grammars is not None:
            self._grammars.close()
        if self._adapters is not None:
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

    def adopt_grammars(self, compiler: GrammarCompiler) -> bool:
        """A compiler built before the engine (a pooled site builds it while it waits: it reads
        only the tokenizer); refused (False) unless it masks this engine's logits width."""
        from site_engine.engine.grammar_compiler import GrammarWaits

        if compiler.vocab_size != self._runner.vocab_size:
            return False
        self._grammars, self._waits = compiler, GrammarWaits(compiler)
        return True

    def grammars(self) -> GrammarCompiler:
        """The compiler of constrained requests' grammars, built on first use (it reads the
        whole vocabulary once, ~1.5 s for SmolLM2's); a site builds it at start-up."""
        if self._grammars is None:
            # Imported on first use: llguidance is needed only where constraints are served.
            # Without it (a bare GPU image) the site serves everything else and refuses
            # constrained requests with a reason, rather than failing to start.
            try:
                from site_engine.engine.grammar_compiler import GrammarCompiler, GrammarWaits
            except ModuleNotFoundError as exc:
                raise StructuredOutputUnavailable(
                    "this site cannot constrain answers (response_format json_schema, forced "
                    f"tools): {exc.name or 'llguidance'} is not installed on it"
                ) from exc

            self._grammars = GrammarCompiler(
                self._loaded.tokenizer,
                self._runner.vocab_size,
                self._loaded.eos_token_ids,
                threads=self._config.grammar_compile_threads,
                timeout_s=self._config.grammar_compile_timeout_s,
            )
            self._waits = GrammarWaits(self._grammars)
        return self._grammars

    def add_request(self, request: EngineRequest) -> None:
        """Queues a request. A constrained one whose grammar is not compiled yet waits for it
        in the queue (its compile runs off this thread): a failed compile ends it later, with
        FinishReason.ERROR, where a cached grammar's failures are refused here."""
        constraint = request.sampling.constraint
        guide = self.grammars().cached(constraint) if constraint is not None else None
        adapter = request.adapter or ""
        adapter_resident = self._request_adapter(adapter)
        if guide is not None:
            _follow_answer_so_far(guide, request.prompt_token_ids, request.sampling)
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
            assert self._waits is not None  # made with the compiler
            self._waits.add(request.request_id, constraint)

    def served_adapters(self) -> tuple[str, ...]:
        """The LoRA adapters requests may name (EngineRequest.adapter), sorted; () if none."""
        return self._adapters.served() if self._adapters is not None else ()

    def load_adapter(self, name: str, path: str) -> None:
        """Any thread: the registry checks the files and links them in under its own lock."""
        registry = self._live_registry()
        if name in registry.entries():
            raise AdapterRefused(AdapterRefused.EXISTS, f"adapter {name!r} is already served")
        try:
            registry.register(name, Path(path))
        except AdapterError as exc:
            raise AdapterRefused(AdapterRefused.INVALID, str(exc)) from exc

    def unload_adapter(self, name: str) -> None:
        """Engine thread. Refused, not drained, while requests of `name` are live: draining
        would hold the caller for as long as the longest of them, and a refusal lets the
        operator choose (retry, or cancel them)."""
        registry = self._live_registry()
        if name not in registry.entries():
            raise AdapterRefused(AdapterRefused.NOT_FOUND, f"adapter {name!r} is not served")
        if name in self._scheduler.live_adapters():
            raise AdapterRefused(
                AdapterRefused.BUSY, f"adapter {name!r} has requests queued or running; retry"
            )
        registry.unregister(name)
        # Cached block ids are keyed by the adapter's name, not its weights: a later adapter of
        # this name must not reuse them. Every id goes (unloads are rare; one AllBlocksCleared).
        self._scheduler.clear_prefix_cache()

    def _live_registry(self) -> AdapterRegistry:
        if self._adapters is None:
            raise AdapterRefused(
                AdapterRefused.BUSY, "this site was started without --lora-dir: no adapters"
            )
        return self._adapters

    @property
    def adapters(self) -> AdapterRegistry | None:
        return self._adapters

    def _request_adapter(self, adapter: str) -> bool:
        """Whether `adapter` ("": none) is in host memory; if not, its load starts (off this
        thread) and its requests wait. RequestRejected for one this engine does not serve."""
        if not adapter:
            return True
        if self._adapters is None:
            raise RequestRejected(f"adapter {adapter!r}: this site serves no LoRA adapters")
        try:
            self._adapters.check_name(adapter)
        except AdapterError as exc:
            raise RequestRejected(str(exc)) from exc
        return self._adapters.request(adapter)

    def _take_adapters(self) -> StepOutputs:
        """Admits the requests of adapters loaded since the last step; ends with an error those
        whose adapter failed to load (a wrong base, shape or rank): their outputs."""
        outputs = StepOutputs()
        if self._adapters is None or not self._adapters.loading:
            return outputs
        ready, failed = self._adapters.settle(self._scheduler.live_adapters)
        for name in ready:
            self._scheduler.adapter_loaded(name)
        for name, why in failed.items():
            for request_id in self._scheduler.awaiting_adapter(name):
                self._scheduler.finish(request_id, FinishReason.ERROR)
                outputs.add(request_id, finish=FinishReason.ERROR, error=why)
        return outputs

    def abort(self, request_id: str, reason: FinishReason) -> bool:
        if self._waits is not None:
            self._waits.drop(request_id)
        return self._scheduler.finish(request_id, reason)

    def release_queued(self, max_requests: int) -> list[EngineRequest]:
        # Never one waiting for its grammar (Scheduler.release_queued).
        return [_as_request(seq) for seq in self._scheduler.release_queued(max_requests)]

    def has_unfinished(self) -> bool:
        return self._scheduler.has_unfinished() or self._in_flight is not None

    def _take_grammars(self) -> StepOutputs:
        """Hands the grammars compiled since the last step to their requests (now admissible)
        and ends those whose compile failed or ran past its time: their outputs."""
        outputs = StepOutputs()
        if not self._waits:
            return outputs
        ready, failed = self._waits.settle(time.monotonic())
        why = {rid: f"the answer's constraint cannot be enforced: {e}" for rid, e in failed.items()}
        for request_id, guide in ready.items():
            seq = self._scheduler.get(request_id)
            assert seq is not None  # a request that leaves stops waiting (abort)
            try:
                _follow_answer_so_far(guide, seq.prompt_token_ids, seq.sampling)
            except RequestRejected as exc:
                why[request_id] = str(exc)
            else:
                self._scheduler.set_guide(request_id, guide)
        for request_id, error in why.items():
            self._scheduler.finish(request_id, FinishReason.ERROR)
            outputs.add(request_id, finish=FinishReason.ERROR, error=error)
        return outputs

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
        if not self.graph_queue.done:
            self.graph_queue.step_done()
            if self.graph_queue.due(busy=True):
                outputs.extend(self._drain())
                self._capture_graphs(busy=True)
        return outputs

    @property
    def graphs_pending(self) -> bool:
        """Lazy graphs: whether some remain to be captured."""
        return not self.graph_queue.done

    @property
    def step_in_flight(self) -> bool:
        """Whether a launched step's results are not applied yet (async scheduling)."""
        return self._in_flight is not None

    def capture_idle_graphs(self) -> int:
        """Lazy graphs, while nothing runs: captures a time-bounded run of the pending graphs
        (CapturePolicy.idle_budget_s); returns how many. The engine thread calls it."""
        if self.has_unfinished() or self._closed:
            return 0
        return self._capture_graphs(busy=False)

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

    def _capture_graphs(self, busy: bool) -> int:
        assert self._in_flight is None, "a graph is captured with no step in flight"
        pending = not self.graph_queue.done
        try:
            count = self.graph_queue.capture(busy)
        except Exception:
            log.exception("capturing CUDA graph %s failed; its steps stay eager",
                          self.graph_queue.failed[-1])  # fmt: skip
            count = 0
        if pending and self.graph_queue.done:
            ready_s = self.graph_queue.ready_s or 0.0
            log.info("graphs ready: %d CUDA graphs captured while serving, %.2f s after the "
                     "engine was built (%d failed, their steps eager)",
                     self._runner.num_graphs, ready_s, len(self.graph_queue.failed))  # fmt: skip
            ready, self.on_graphs_ready = self.on_graphs_ready, None  # the start's graphs only
            if ready is not None:
                ready(ready_s)
        return count

    def record_step_seconds(self, seconds: float) -> None:
        """The last step() took `seconds`: charged to the step whose tokens it applied (with
        async scheduling it waited for that step's results), for the learned step cost."""
        applied, self._applied_work = self._applied_work, None
        if applied is not None:
            self._scheduler.observe_step(applied[0], applied[1], seconds)

    def _step(self) -> StepOutputs:
        failed = self._take_grammars()
        failed.extend(self._take_adapters())
        scheduled = self._scheduler.schedule()
        idle = scheduled.is_empty and not scheduled.kv_copies  # copies back: a step follows
        if idle and self._in_flight is None and not failed:
            # Nothing to run but requests waiting for their grammars or adapters: wait for one
            # (briefly).
            if self._waits:
                self._waits.wait(_GRAMMAR_WAIT_S)
            elif self._adapters is not None:
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

    def kv_room(self) -> int:
        """Bytes `lend_kv` could lend now (0 while lending). Engine thread."""
        return lendable_bytes(self._scheduler.block_manager, self._plan)

    def lend_kv(self, wanted_bytes: int) -> int:
        """Engine thread. Lends the free top of the cache covering `wanted_bytes`
        (core/kv_lending.py: never a block a sequence holds) and releases its memory: the cache
        shrinks (ModelRunner.resize_kv). Returns the bytes lent (0: refused, nothing lent;
        also when the shrink could not allocate its one new layer). ValueError while lending."""
        if wanted_bytes < 1:
            raise ValueError(f"a lending needs at least one byte, not {wanted_bytes}")
        if self._scheduler.block_manager.draining:
            return 0  # the trainer's reserve is being drained: nothing for a neighbour
        return self._take_lending(wanted_bytes, drain=False)

    def reserve_kv(self, wanted_bytes: int) -> bool:
        """Engine thread. The site's own fine-tuning takes `wanted_bytes` from the top of the
        cache while a job trains (EngineConfig.finetune_reserve_on_demand): lent as to a
        neighbour (the memory released), after draining it when running sequences hold part of
        it (no new sequence takes those blocks meanwhile). Whether the reserve is held now;
        False: not yet (call again between steps), or the cache lends to a neighbour."""
        if self._lending is not None:
            return self._reserved
        self._reserved = self._take_lending(wanted_bytes, drain=True) > 0
        return self._reserved

    def release_kv_reserve(self) -> int:
        """Engine thread. No job trains: the reserve (or a drain toward it) is the cache's
        again; the bytes given back."""
        if not self._reserved:
            self._scheduler.block_manager.end_drain()
            return 0
        returned = self._give_back()
        self._reserved = False
        return returned

    def _take_lending(self, wanted_bytes: int, drain: bool) -> int:
        manager = self._scheduler.block_manager
        lending = lend(manager, self._plan, wanted_bytes, drain=drain)
        if not lending.blocks:
            return 0
        try:
            self._resize_cache(lending.plan.num_blocks)
        except torch.OutOfMemoryError:
            log.warning("the KV cache could not shrink to lend %d bytes", lending.bytes)
            take_back(manager, lending, self._plan)
            return 0
        self._lending, self._plan = lending, lending.plan
        self._limits = replace(self._limits, kv_blocks_total=lending.plan.num_blocks)
        return lending.bytes

    def return_kv(self) -> int:
        """Engine thread. The neighbour left: the cache grows back (its memory re-acquired) and
        the lent blocks are the scheduler's again; the bytes returned (0: nothing was lent).
        Raises if the memory cannot be had again (the blocks stay lent; a later call may try
        again)."""
        if self._reserved:
            return 0  # the trainer's reserve, not a neighbour's: release_kv_reserve gives it back
        return self._give_back()

    def _give_back(self) -> int:
        lending = self._lending
        if lending is None:
            return 0
        self._resize_cache(lending.plan.num_blocks + lending.blocks)
        self._plan = take_back(self._scheduler.block_manager, lending, self._plan)
        self._lending = None
        self._limits = replace(self._limits, kv_blocks_total=self._plan.num_blocks)
        return lending.bytes

    def _resize_cache(self, num_blocks: int) -> None:
        # The queue's callables hold the old graph sets (their memory pools): dropped first.
        self.graph_queue = GraphCaptureQueue()
        try:
            self._runner.resize_kv(num_blocks)
        finally:
            # The graphs were made again over the resized (or restored) cache: lazy ones are
            # captured again between steps, from the start.
            self.graph_queue = GraphCaptureQueue(self._runner.pending_graphs(), self._pace)

    def restart_scheduler(self, *, prefix_caching: bool, host_tier: bool) -> None:
        """An idle engine starts over with an empty scheduler and cache index on the same runner
        (its CUDA graphs stay captured): a benchmark's arms with caching off, on, and with the
        host tier (if the runner has one) compare on one warmed-up engine."""
        if self.has_unfinished() or self._lending is not None:
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
        lora = self._adapters.residency() if self._adapters is not None else AdapterResidency()
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
            host_kv_bytes_offloaded=stats.host_kv_blocks_offloaded * self._limits.kv_block_bytes,
            host_kv_bytes_onloaded=stats.host_kv_blocks_onloaded * self._limits.kv_block_bytes,
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


def _offload_limits(config: EngineConfig, block_bytes: int) -> OffloadLimits:
    blocks = config.host_kv_offload_bytes_per_step // block_bytes
    if config.host_kv_cache_bytes and blocks < 1:
        raise ValueError(
            f"host_kv_offload_bytes_per_step ({config.host_kv_offload_bytes_per_step}) must "
            f"cover at least one KV block of {block_bytes} bytes"
        )
    return OffloadLimits(max(blocks, 1), config.host_kv_active_window_steps)


def _adapter_registry(loaded: LoadedModel, settings: LoraSettings | None) -> AdapterRegistry | None:
    if settings is None:
        return None
    base = BaseShapes.of_model(loaded.model)
    return AdapterRegistry(settings, base, loaded.dtype, loaded.device)


def _device_memory(device: torch.device) -> tuple[int, int]:
    """(bytes torch has reserved, bytes in use on the device), or zeros off CUDA."""
    if device.type != "cuda":
        return 0, 0
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return torch.cuda.memory_reserved(device), total - free


def _follow_answer_so_far(guide: Guide, prompt: tuple[int, ...], sampling: SamplingParams) -> None:
    """A continuation's prompt ends with the answer so far: its grammar goes on from there."""
    before = sampling.generated_before
    if before and (before > len(prompt) or not all(map(guide.consume, prompt[-before:]))):
        raise RequestRejected("the answer so far does not follow its constraint")


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
