"""What the serving layer needs from an engine, independent of how it schedules.

RequestOutput and StepOutputs (core/outputs.py) are re-exported here.

The engine is driven from a single thread (see site_engine/engine_service.py): every method
here is called from that thread only, so engines need no locks. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from fedllm_contract.cache_events import CacheEvent
from fedllm_contract.priority import Priority
from site_engine.engine.core.outputs import RequestOutput, StepOutputs
from site_engine.engine.core.scheduler_config import ClassLoad
from site_engine.engine.core.types import FinishReason, SamplingParams

__all__ = [
    "AdapterRefused", "Engine", "EngineLimits", "EngineRequest", "EngineStats", "RequestOutput",
    "RequestRejected", "StepOutputs", "StructuredOutputUnavailable",
]  # fmt: skip


class RequestRejected(ValueError):
    """The request can never be served by this engine (e.g. longer than the context)."""


class StructuredOutputUnavailable(RequestRejected):
    """This site cannot constrain answers (JSON schema, tools): llguidance is not installed."""


class AdapterRefused(ValueError):
    """A LoRA adapter cannot be loaded or unloaded; `reason` says which way (the gRPC status)."""

    INVALID = "invalid"  # does not fit the base, or a bad name or path
    EXISTS = "exists"  # the name is served already
    NOT_FOUND = "not_found"  # unloading one not served
    BUSY = "busy"  # requests of it are live, or the site serves no adapters

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    # The gateway's response-length prediction in tokens, if it made one.
    predicted_tokens: int | None = None
    # Mixed into the prefix cache's block ids: only requests of one salt share cached blocks.
    cache_salt: str = ""
    # False for one choice of a request with several (they are never released for offload).
    releasable: bool = True
    # The LoRA adapter the request is for (None: the base model); the serving layer refuses an
    # adapter the site does not serve before the engine sees it.
    adapter: str | None = None
    # Its class: interactive first; flex and batch fill the capacity it leaves (scheduling/).
    priority: Priority = Priority.INTERACTIVE


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_waiting: int
    num_running: int
    queued_prompt_tokens: int
    running_tokens: int
    predicted_remaining_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    iterations: int
    num_preemptions: int = 0
    # The prefix cache's cumulative counters, in tokens
    # (site_engine/engine/core/scheduler_config.py).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_host_hits: int = 0
    prompt_tokens_computed: int = 0
    kv_blocks_cached: int = 0
    # Bytes copied to and back from the prefix cache's host tier since start.
    host_kv_bytes_offloaded: int = 0
    host_kv_bytes_onloaded: int = 0
    # Blocks evicted without a host copy: worth one but over the per-step budget, or unlikely
    # to be read again (site_engine/engine/core/host_offload.py).
    host_kv_blocks_skipped_budget: int = 0
    host_kv_blocks_declined: int = 0
    # Waiting, running and preempted sequences of each priority class, interactive first.
    by_class: tuple[ClassLoad, ...] = ()
    # LoRA adapters in device slots, those only in host memory (sorted), and the mean seconds
    # a read from disk took lately (0.0: none yet): what routing weighs an adapter's site by.
    adapters_on_device: tuple[str, ...] = ()
    adapters_in_host: tuple[str, ...] = ()
    adapter_load_s: float = 0.0
    # Since start (lora/registry.py AdapterResidency): adapters loaded for requests, loads that
    # failed, requests that waited for their adapter, and the seconds they waited, summed.
    adapter_loads: int = 0
    adapter_load_failures: int = 0
    adapter_waits: int = 0
    adapter_wait_s: float = 0.0
    # What a step costs as the engine learned it (core/step_cost.py): seconds of its base, a
    # computed token and a KV position read; () until enough steps were seen.
    step_cost_s: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_model_len: int
    kv_block_size: int
    kv_blocks_total: int
    max_num_seqs: int
    name: str
    prefix_caching: bool = False
    host_kv_blocks: int = 0
    # Bytes of one KV block (all layers, K and V): what a host-tier copy moves.
    kv_block_bytes: int = 0


class Engine(Protocol):
    @property
    def limits(self) -> EngineLimits: ...

    def add_request(self, request: EngineRequest) -> None:
        """Queues a request; raises RequestRejected if it can never be served."""

    def abort(self, request_id: str, reason: FinishReason) -> bool:
        """Removes a queued or running request and frees its memory; False if unknown."""

    def release_queued(self, max_requests: int) -> list[EngineRequest]:
        """Removes up to max_requests queued requests that have not started and returns them."""

    def step(self) -> StepOutputs:
        """Runs one iteration; returns the outputs it produced (possibly none)."""

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def queue_lengths(self) -> tuple[int, int]:
        """(waiting, running) requests: what stats() counts of them, without its pass over
        the running rows (the site's queue bound reads it for every request added)."""

    def take_cache_events(self) -> list[CacheEvent]:
        """Prefix-cache changes since the last call (none without prefix caching)."""

    def cache_snapshot(self) -> list[CacheEvent]:
        """Every cached block id held now, as BlocksStored events."""

    def served_adapters(self) -> tuple[str, ...]:
        """The LoRA adapters EngineRequest.adapter may name, sorted; () for the base only.
        Unlike the other methods, callable from any thread (it reads the adapter directory)."""

    def load_adapter(self, name: str, path: str) -> None:
        """Serves the PEFT adapter in directory `path` as `name` from now on; AdapterRefused,
        nothing changed, otherwise. Callable from any thread (it reads files)."""

    def unload_adapter(self, name: str) -> None:
        """Stops serving `name`; AdapterRefused (BUSY) while a request of it is live."""

    def kv_room(self) -> int:
        """Bytes of the KV cache `lend_kv` could lend now (idle memory first; 0 while lending)."""

    def lend_kv(self, wanted_bytes: int) -> int:
        """Lends the free top of the KV cache covering `wanted_bytes` to an instance beside
        this one and releases its memory: the bytes lent (0: refused). ValueError while it
        lends already or for less than one byte."""

    def return_kv(self) -> int:
        """Re-acquires the lent memory and takes the blocks back: the bytes (0: none lent)."""
