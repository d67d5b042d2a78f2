"""A simulated site: the real engine core (site_engine.engine.core.scheduler.Scheduler, with its
block manager, prefix cache, priority classes and adapter slots) stepped on the virtual clock,
the model's forward replaced by the fitted step time (fedsim/step_time.py).

Each step is the engine's own loop: after the step's fitted time it is updated with one sampled
token per sampling chunk (EOS once a sequence reaches the answer length the workload gave it).
With async scheduling (`SiteSpec.async_scheduling`, PagedEngine's default on a GPU) a step is
planned when its predecessor starts, before that one's tokens are known, as
`PagedEngine._run_step` does: step N starts, N+1 is scheduled at once; when N's time has passed N
is updated and N+1 starts, N+2 is scheduled then, and so on. A request that arrives while N runs
therefore joins N+2 at the earliest. A planned step that is empty is updated with no tokens right
after N, and the next step is scheduled afresh once N is applied (the engine applies an empty
step at once). A sequence that N finishes still has its row in N+1 (computed, its token thrown
away): that row gets no token here, as the scheduler ignores chunks of finished sequences.
Synchronously (async_scheduling False): schedule, step, update, schedule.

A LoRA adapter not in the site's host memory is read from disk first (the scheduler holds its
requests back, `awaiting_adapter`); the adapter's device slots are the scheduler's `max_loras`.
The load reports are built from the scheduler's stats and the engine's own step rates
(site_engine/step_rates.py), as the site's server does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from fedllm_contract.cache_events import CacheEventBatch
from fedllm_contract.priority import Priority
from fedsim.cards import Card, ModelShape, kv_blocks
from fedsim.events import EventLoop
from fedsim.step_time import StepFeatures, StepTimeModel
from gateway.sites.interface import ClassLoadView, LoadView, SiteInfoView
from site_engine.engine.core.outputs import StepOutputs
from site_engine.engine.core.scheduler import Scheduler, SchedulerConfig
from site_engine.engine.core.scheduling_policy import PolicyName
from site_engine.engine.core.types import (
    FinishReason,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from site_engine.step_rates import StepRates, StepWork

IntArray = npt.NDArray[np.int64]
EOS = 0
TOKEN = 1  # every other sampled token: the simulation needs lengths, not text
MODEL = "sim-model"


@dataclass(frozen=True, slots=True)
class SiteSpec:
    name: str
    card: Card
    model: ModelShape
    step: StepTimeModel  # already on this card
    rtt_s: float
    region: str = "region"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    prefix_caching: bool = True
    max_loras: int = 0
    max_cpu_loras: int = 0
    adapter_load_s: float = 0.5
    adapter_overtake_steps: int | None = None  # None: the engine's default
    max_model_len: int | None = None
    policy: PolicyName = "fcfs"
    # PagedEngine schedules asynchronously on CUDA (its default there): step N+1 is planned when
    # step N starts, so an arrival waits for the rest of N and all of N+1 before its own step.
    # False: the engine's synchronous loop (its default off CUDA, or `overlap=False`).
    async_scheduling: bool = True
    # The KV blocks a real site reported (a replay of a measured federation); None: from the
    # card's memory less the weights.
    kv_blocks: int | None = None
    # The share of its answer tokens that carry text (a client counts a chunk, and its first
    # token, only with text): 1 for a real model; a random-weight model picks ids uniformly
    # over its vocabulary, and those past its tokenizer's have none (bench/federation_real/
    # sim.py: the tokenizer's size over the model's vocabulary).
    text_share: float = 1.0
    # Its steps' seconds over the step model's: the serving process around the engine (its gRPC
    # loop, detokenizing, the service's per-step work) where the model is a bare engine's.
    step_scale: float = 1.0
    # The least seconds a step takes per token it gives: the site process's engine thread (its
    # host work) and serving thread (detokenizing, gRPC) take turns on one interpreter lock, so
    # past some batch the process, not the device, sets the step's pace (0: no floor; issue 78).
    token_floor_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.text_share <= 1.0:
            raise ValueError(f"text_share must be in (0, 1], got {self.text_share}")
        if not self.step_scale > 0.0:
            raise ValueError(f"step_scale must be > 0, got {self.step_scale}")
        if not self.token_floor_s >= 0.0:
            raise ValueError(f"token_floor_s must be >= 0, got {self.token_floor_s}")

    @property
    def num_blocks(self) -> int:
        if self.kv_blocks is not None:
            return self.kv_blocks
        return kv_blocks(self.card, self.model, self.block_size)

    @property
    def context(self) -> int:
        return self.max_model_len or self.model.max_model_len


# What the site tells its owner after each step: (site, updates) at the step's end.
OnUpdates = Callable[["SimSite", StepOutputs], None]


class SimSite:
    """One engine on the virtual clock (the module docstring)."""

    def __init__(self, spec: SiteSpec, loop: EventLoop, on_updates: OnUpdates) -> None:
        self.spec = spec
        self.name = spec.name
        self._loop = loop
        self._on_updates = on_updates
        config = SchedulerConfig(
            num_blocks=spec.num_blocks,
            block_size=spec.block_size,
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            max_model_len=spec.context,
            policy=spec.policy,
            eos_token_ids=frozenset({EOS}),
            prefix_caching=spec.prefix_caching,
            model_name=MODEL,
            max_loras=spec.max_loras,
        )
        if spec.adapter_overtake_steps is not None:
            config = replace(config, adapter_overtake_steps=spec.adapter_overtake_steps)
        self.scheduler = Scheduler(config)
        self._answers: dict[str, int] = {}  # request id -> answer length to produce
        self._host: OrderedDict[str, None] = OrderedDict()  # adapters in host memory, LRU
        self._loading: set[str] = set()
        # Reads of an adapter from disk started here, and the adapters its requests named.
        self.adapter_loads = 0
        self.adapters_served: set[str] = set()
        self._busy = False
        # With async scheduling: the step planned to follow the one running (_start).
        self._planned: SchedulerOutput | None = None
        self.alive = True
        self.rates = StepRates()
        self.steps = 0
        self.busy_s = 0.0
        self._report_sequence = 0
        # Each step's chunks as (request id, tokens), when asked for (tests compare schedules).
        self.trace: list[tuple[tuple[str, int], ...]] | None = None
        # (class, the scheduler's arrival index) of each request in the order first admitted:
        # how many later arrivals were admitted ahead of each (the SPF bound's measure).
        self.admissions: list[tuple[Priority, int]] = []
        self._admitted: set[str] = set()

    # -- requests -------------------------------------------------------------------------
    def add(
        self,
        request_id: str,
        prompt: tuple[int, ...],
        answer_tokens: int,
        max_tokens: int,
        predicted: int | None,
        adapter: str = "",
        priority: Priority = Priority.INTERACTIVE,
    ) -> None:
        """Queue a request that answers `answer_tokens` tokens (ValueError as the engine's)."""
        if not self.alive:
            raise ConnectionError(f"site {self.name} is down")
        awaiting = bool(adapter) and adapter not in self._host
        self.scheduler.add(
            request_id,
            prompt,
            SamplingParams(max_tokens=max_tokens, temperature=0.0),
            predicted_tokens=predicted,
            priority=priority,
            adapter=adapter,
            awaiting_adapter=awaiting,
        )
        self._answers[request_id] = answer_tokens
        if adapter:
            self.adapters_served.add(adapter)
        if awaiting:
            self._load(adapter)
        elif adapter:
            self._host.move_to_end(adapter)
        self._wake()

    def release_queued(self, count: int) -> list[str]:
        """Hand back up to `count` never-started requests (offload): their ids."""
        released = self.scheduler.release_queued(count)
        for seq in released:
            self._answers.pop(seq.request_id, None)
        return [seq.request_id for seq in released]

    def fail(self) -> list[str]:
        """The site dies: every live request is lost; their ids."""
        self.alive = False
        lost = list(self._answers)
        self._answers.clear()
        return lost

    # -- adapters -------------------------------------------------------------------------
    def _load(self, adapter: str) -> None:
        if adapter in self._loading:
            return
        self._loading.add(adapter)
        self.adapter_loads += 1
        self._loop.after(self.spec.adapter_load_s, lambda: self._loaded(adapter))

    def _loaded(self, adapter: str) -> None:
        self._loading.discard(adapter)
        if not self.alive:
            return
        self._host[adapter] = None
        self._host.move_to_end(adapter)
        live = self.scheduler.live_adapters()
        while len(self._host) > max(self.spec.max_cpu_loras, 1):
            oldest = next((a for a in self._host if a not in live), None)
            if oldest is None:
                break
            del self._host[oldest]
        self.scheduler.adapter_loaded(adapter)
        self._wake()

    # -- the step loop --------------------------------------------------------------------
    def _wake(self) -> None:
        if not self._busy and self.alive and self.scheduler.has_unfinished():
            self._step()

    def _schedule(self) -> SchedulerOutput:
        output = self.scheduler.schedule()
        for chunk in output.chunks:
            if chunk.request_id not in self._admitted:
                self._admitted.add(chunk.request_id)
                seq = self.scheduler.get(chunk.request_id)
                if seq is not None:
                    self.admissions.append((seq.priority, seq.arrival_index))
        return output

    def _step(self) -> None:
        output = self._schedule()
        if output.is_empty:  # nothing runnable now (adapters loading): idle until an event
            self.scheduler.update(output, ModelRunnerOutput({}))
            return
        self._start(output)

    def _start(self, output: SchedulerOutput) -> None:
        if self.trace is not None:
            self.trace.append(tuple((c.request_id, len(c.token_ids)) for c in output.chunks))
        features = StepFeatures.of(output)
        seconds = self.spec.step.seconds(features) * self.spec.step_scale
        if self.spec.token_floor_s:
            seconds = max(seconds, output.num_sampled * self.spec.token_floor_s)
        self._busy = True
        if self.spec.async_scheduling:  # the successor is planned as this step starts
            self._planned = self._schedule()
        self._loop.after(seconds, lambda: self._finish(output, features, seconds))

    def _finish(self, output: SchedulerOutput, features: StepFeatures, seconds: float) -> None:
        planned, self._planned = self._planned, None
        if not self.alive:
            self._busy = False
            return
        # Rows of sequences an earlier step finished get no token (the scheduler ignores them).
        updates = self.scheduler.update(output, ModelRunnerOutput(tokens=self._sample(output)))
        self._account(output, features, seconds, updates)
        for index in updates.finished:
            self._answers.pop(updates.request_ids[index], None)
        if planned is not None and planned.is_empty:
            # Nothing to overlap with: applied now, and the next step is planned afresh.
            self.scheduler.update(planned, ModelRunnerOutput({}))
            planned = None
        # A planned step is already launched behind this one: an arrival while the updates are
        # delivered waits for the step after it.
        self._busy = planned is not None
        self._on_updates(self, updates)
        if planned is not None:
            self._start(planned)
        else:
            self._wake()

    def _account(
        self,
        output: SchedulerOutput,
        features: StepFeatures,
        seconds: float,
        updates: StepOutputs,
    ) -> None:
        """The step's cost for the scheduler's step cost, the step rates and the site's totals."""
        self.scheduler.observe_step(output.num_tokens, output.context_tokens, seconds)
        # Tokens past a request's first (its prefill's): every output but first tokens.
        firsts = sum(1 for c in output.prefill_chunks if c.sample and c.num_generated == 0)
        decoded = max(len(updates) - firsts, 0)
        self.rates.add(
            StepWork(
                self._loop.now(),
                seconds,
                decoded,
                features.decode_rows > 0,
                features.prefill_tokens,
            )
        )
        self.steps += 1
        self.busy_s += seconds

    def _sample(self, output: SchedulerOutput) -> IntArray:
        """Every sampled row's token, in the step's sample order: EOS at the answer's last
        token, another token before it."""
        answers = self._answers
        chunks = [c for c in output.prefill_chunks if c.sample]
        wanted = np.array(
            [answers.get(seq.request_id, 1) for seq in output.decode_seqs]
            + [answers.get(c.request_id, 1) for c in chunks],
            dtype=np.int64,
        )
        produced = np.concatenate(
            [output.decode_generated, np.array([c.num_generated for c in chunks], dtype=np.int64)]
        )
        return np.where(produced + 1 >= wanted, EOS, TOKEN).astype(np.int64)

    # -- what the site reports ------------------------------------------------------------
    def info_view(self) -> SiteInfoView:
        """What the site's Info call answers (the gateway's view of its limits)."""
        spec = self.spec
        return SiteInfoView(
            site_name=spec.name,
            model=MODEL,
            max_model_len=spec.context,
            vocab_size=1 << 17,
            tokenizer_fingerprint="sim",
            device=spec.card.name,
            dtype="bfloat16",
            kv_block_size=spec.block_size,
            kv_blocks_total=spec.num_blocks,
            max_num_seqs=spec.max_num_seqs,
            engine="paged-fcfs",
            version="fedsim",
            prefix_caching=spec.prefix_caching,
            adapters=tuple(f"lora{i:03d}" for i in range(1000)) if spec.max_loras else (),
        )

    def load_view(self) -> LoadView:
        """A load report, as the site's server builds it from the engine's stats."""
        stats = self.scheduler.stats()
        now = self._loop.now()
        events = None
        if self.spec.prefix_caching:
            self._report_sequence += 1
            first = self._report_sequence == 1
            taken = self.scheduler.take_cache_events()
            listed = self.scheduler.cache_snapshot() if first else taken
            events = CacheEventBatch(
                1, self.spec.block_size, self._report_sequence, tuple(listed), snapshot=first
            )
        on_device = tuple(sorted(self.scheduler.live_adapters()))
        return LoadView(
            queued_requests=stats.num_waiting,
            running_requests=stats.num_running,
            queued_prompt_tokens=stats.queued_prompt_tokens,
            running_tokens=stats.cached_tokens,
            predicted_remaining_tokens=stats.predicted_remaining_tokens,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            decode_tokens_per_s=self.rates.decode_tokens_per_s(now),
            iterations=stats.iterations,
            sequence=self._report_sequence,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            cache_events=events,
            prefill_tokens_per_s=self.rates.prefill_tokens_per_s(now),
            by_class=tuple(
                ClassLoadView(
                    c.priority,
                    c.num_waiting,
                    c.num_running,
                    c.queued_prompt_tokens,
                    c.running_tokens,
                    c.predicted_remaining_tokens,
                )
                for c in stats.by_class
            ),
            adapters_on_device=on_device,
            adapters_in_host=tuple(a for a in self._host if a not in on_device),
            adapter_load_s=self.spec.adapter_load_s if self.spec.max_loras else 0.0,
        )


__all__ = ["EOS", "MODEL", "FinishReason", "SimSite", "SiteSpec"]
