"""What the gateway needs of a site, whatever engine serves it: the SiteClient protocol, the typed
values it passes, and the failures the dispatcher acts on (SiteUnavailable: try another site;
SiteRejected: the client's fault; SiteFailed: the site broke under the request).

GrpcSiteClient (gateway/sites/grpc_client.py) is the first implementation, for this project's
site engines; a site kind that speaks another protocol (an OpenAI-compatible HTTP server)
implements the same protocol, and says which optional capabilities it has.

A site serves one model, of one task: a generative model's site generates (generate), an
embedding model's embeds (embed); the gateway sends each only what its model's task does.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, Protocol, get_args, runtime_checkable

from fedllm_contract.cache_events import CacheEventBatch
from fedllm_contract.fine_tuning import FineTuneProgress, FineTuneSpec
from fedllm_contract.priority import Priority
from fedllm_contract.request_options import RequestOptions
from gateway.federation import ModelTask

# What a request may need of its site beyond plain generation; a site says which it has.
# "continue_constraint": it continues a constrained answer from the tokens produced elsewhere
# (its grammar goes on from them: generated_before).
Capability = Literal[
    "n",
    "logprobs",
    "penalties",
    "logit_bias",
    "json_schema",
    "json_object",
    "tagged_json",
    "continue_constraint",
]
ALL_CAPABILITIES: frozenset[Capability] = frozenset(get_args(Capability))


class SiteCallError(Exception):
    def __init__(self, site: str, message: str) -> None:
        super().__init__(f"site {site}: {message}")
        self.site = site
        self.detail = message


class SiteUnavailable(SiteCallError):
    """The site could not take the call (down, unreachable, overloaded): try another site."""


class SiteBusy(SiteUnavailable):
    """The site's waiting queue is full (RESOURCE_EXHAUSTED): try another site; the site
    itself is healthy."""


class SiteRejected(SiteCallError):
    """The site refused the request as invalid."""


class SiteFailed(SiteCallError):
    """The site accepted the request and then failed it."""


class AdapterChangeRefused(SiteCallError):
    """The site refused to load or unload a LoRA adapter. `reason`: "invalid" (does not fit the
    base, a bad name or path), "exists" (the name is served), "not_found" (unloading one not
    served), "busy" (requests of it are live, or the site serves no adapters)."""

    def __init__(self, site: str, message: str, reason: str) -> None:
        super().__init__(site, message)
        self.reason = reason


class FineTuneCallRefused(SiteRejected):
    """The site refused a fine-tuning call. `reason`: "invalid" (another base model, a bad file
    or hyperparameters), "exists" (the job id is known), "not_found" (no such job),
    "precondition" (the site takes no jobs, or its reserve cannot hold one example),
    "too_large" (the job's files pass what the site takes in one message: it never will)."""

    def __init__(self, site: str, message: str, reason: str) -> None:
        super().__init__(site, message)
        self.reason = reason


class KvLeaseLost(SiteRejected):
    """The site holds no lending under the lease named (it expired and was taken back)."""


class SiteTimedOut(SiteFailed):
    """The call's deadline (the request's timeout) passed after the site accepted it; the site
    sees the deadline too and cancels the request."""


@dataclass(frozen=True, slots=True)
class SiteInfoView:
    site_name: str
    model: str
    max_model_len: int
    vocab_size: int
    tokenizer_fingerprint: str
    device: str
    dtype: str
    kv_block_size: int
    kv_blocks_total: int
    max_num_seqs: int
    engine: str
    version: str
    # Prefix caching: whether the site caches, the scheme of its block ids
    # (fedllm_contract.block_hash.HASH_SCHEME), and the blocks of its host-memory tier.
    prefix_caching: bool = False
    block_hash_scheme: str = ""
    host_kv_blocks: int = 0
    # What the site's model does; an embedding site says its vectors' length (0: not said).
    task: ModelTask = "generate"
    embedding_dimension: int = 0
    # The LoRA adapters of its model the site serves (each by its name; none: the base only).
    adapters: tuple[str, ...] = ()
    # Whether the site takes LoRA fine-tuning jobs of its model (FineTuningSite; issue 54), and
    # the most tokens a training example may have in its memory reserve (0: not said).
    accepts_fine_tuning: bool = False
    fine_tuning_max_example_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ClassLoadView:
    """One priority class's share of a site's load report."""

    priority: Priority
    queued_requests: int = 0
    running_requests: int = 0
    queued_prompt_tokens: int = 0
    running_tokens: int = 0
    predicted_remaining_tokens: int = 0


@dataclass(frozen=True, slots=True)
class LoadView:
    """One load report of a site, as the gateway keeps it."""

    queued_requests: int
    running_requests: int
    queued_prompt_tokens: int
    running_tokens: int
    predicted_remaining_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    decode_tokens_per_s: float
    iterations: int
    sequence: int
    # Cumulative KV use since the site started (sum over iterations); benchmarks diff them.
    kv_block_iterations: int = 0
    kv_token_iterations: int = 0
    # Prefix cache, cumulative since the site started, in prompt tokens: looked up at admission,
    # found cached (either tier), of those copied back from the host tier.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_host_hits: int = 0
    # What changed in the site's cache since the previous report (only when asked for).
    cache_events: CacheEventBatch | None = None
    # Prompt tokens computed per second of the steps that computed some (0: none lately, or an
    # engine that does not say).
    prefill_tokens_per_s: float = 0.0
    # The totals split by priority class (interactive first); empty from a site that does not
    # tell classes apart, whose work then all counts as interactive.
    by_class: tuple[ClassLoadView, ...] = ()
    # Its LoRA adapters in device slots and only in host memory (the rest of those it serves are
    # on disk), and the mean seconds its last reads from disk took (0.0: not measured).
    adapters_on_device: tuple[str, ...] = ()
    adapters_in_host: tuple[str, ...] = ()
    adapter_load_s: float = 0.0

    @property
    def token_load(self) -> int:
        """Queued prompts + tokens held by running sequences + predicted remaining answers."""
        return self.queued_prompt_tokens + self.running_tokens + self.predicted_remaining_tokens

    @property
    def interactive_requests(self) -> int:
        """Interactive requests queued and running: what background work waits behind at the
        site (all of them from a site that does not report classes)."""
        if not self.by_class:
            return self.queued_requests + self.running_requests
        return sum(
            c.queued_requests + c.running_requests
            for c in self.by_class
            if c.priority is Priority.INTERACTIVE
        )


@dataclass(frozen=True, slots=True)
class GenerateParams:
    """One call of a site: the prompt, the answer's length, the request's options (one value
    from the HTTP edge to the engine: fedllm_contract/request_options.py), and what this call
    adds to them (the continuation's offset, the cache salt, the prediction)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    options: RequestOptions = field(default_factory=RequestOptions)
    predicted_tokens: int | None = None
    # Answer tokens produced on another site before this call (a continuation; see dispatch.py).
    generated_before: int = 0
    # Mixed into the site's prefix-cache block ids: only requests of one salt share blocks.
    cache_salt: str = ""

    def needs(self) -> frozenset[Capability]:
        """What this request needs of its site beyond plain generation."""
        options = self.options
        needed: set[Capability] = set()
        if options.n > 1:
            needed.add("n")
        if options.logprobs:
            needed.add("logprobs")
        if options.presence_penalty or options.frequency_penalty:
            needed.add("penalties")
        if options.logit_bias:
            needed.add("logit_bias")
        if options.constraint is not None:
            needed.add(options.constraint.kind)
        return frozenset(needed)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's log probability and the most likely alternatives at its position, each
    as (token id, or None when the site said only its text; its text, or None when the site
    said only its id; log probability)."""

    logprob: float
    top: tuple[tuple[int | None, str | None, float], ...] = ()


@dataclass(frozen=True, slots=True)
class SiteChunk:
    accepted: bool
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens the site took from its prefix cache (on the last chunk).
    cached_prompt_tokens: int = 0
    # Which choice the chunk is of (n > 1); its tokens' logprobs when they were asked for.
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class EmbedParams:
    request_id: str
    # Each input's token ids, special tokens included as the model's tokenizer adds them.
    inputs: tuple[tuple[int, ...], ...]
    # OpenAI's `dimensions` (None: the model's own length); a site that cannot shorten its
    # vectors refuses another (SiteRejected).
    dimensions: int | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.inputs))


@dataclass(frozen=True, slots=True)
class EmbedResult:
    # One vector per input, in order, as float32 little-endian bytes (OpenAI's base64 bytes).
    vectors: tuple[bytes, ...]
    prompt_tokens: int


class HealthAnswer(Enum):
    """What one health check heard. SERVING, NOT_SERVING (the site says so) and REFUSED
    (nothing answers at its address: connection refused or reset, TLS refused) are definite;
    NO_ANSWER (nothing within the deadline) is not: an overloaded site, or a gateway whose own
    event loop runs late, looks the same as a hung one for one check (gateway/sites/health.py
    decides over several). Truthy only when SERVING, so `if await client.check_health()`
    reads as it did when the answer was a bool."""

    SERVING = "serving"
    NOT_SERVING = "not_serving"
    REFUSED = "refused"
    NO_ANSWER = "no_answer"

    def __bool__(self) -> bool:
        return self is HealthAnswer.SERVING


class SiteClient(Protocol):
    """One site, as routing, dispatch, health checks and load tracking use it."""

    name: str
    # Optional capability: the site can hand back queued, not-started requests (offload, drain).
    can_release_queued: bool
    # What the site can do beyond plain generation (a request needing more is not sent there).
    capabilities: frozenset[Capability]

    def generate(self, params: GenerateParams, timeout_s: float) -> AsyncGenerator[SiteChunk, None]:
        """Streams the answer; closing the iterator early cancels the request at the site. The
        first chunk says whether the site accepted it; the last carries finish_reason."""
        ...

    async def embed(self, params: EmbedParams, timeout_s: float) -> EmbedResult:
        """The inputs' vectors, from a site whose model is an embedding model; SiteUnavailable
        (try another site), SiteRejected (the request's fault), SiteFailed or SiteTimedOut."""
        ...

    async def cancel(self, request_id: str) -> bool: ...

    async def check_health(self) -> HealthAnswer: ...

    async def info(self) -> SiteInfoView:
        """What the site serves (model, context, tokenizer fingerprint, capacity)."""
        ...

    def load_reports(
        self, interval_ms: int, cache_events: bool = False
    ) -> AsyncGenerator[LoadView, None]:
        """The site's load reports as it pushes them; raises SiteUnavailable when they stop.
        With `cache_events`, a site that caches prefixes adds its cache events to each report
        (the first one a snapshot); a site that cannot leaves them out."""
        ...

    async def release_queued(self, max_requests: int) -> list[str]:
        """Hands back up to max_requests queued, not-started requests (their streams end with
        finish_reason "released"); only when can_release_queued."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class AdapterLoading(Protocol):
    """A site that loads and unloads LoRA adapters at run time (this project's site engines;
    docs/engine.md). Both answer the adapters the site serves after the change;
    AdapterChangeRefused when the site refuses, SiteUnavailable when it cannot be reached."""

    async def load_adapter(self, name: str, path: str) -> tuple[str, ...]: ...

    async def unload_adapter(self, name: str) -> tuple[str, ...]: ...


@dataclass(frozen=True, slots=True)
class KvLease:
    """The lease a lending is held by: `id` a secret the gateway chose (only calls naming it
    return or renew the lending), `ttl_s` how long the site keeps it lent unrenewed."""

    id: str = field(repr=False)
    ttl_s: float


@runtime_checkable
class KvLendingSite(Protocol):
    """A site whose KV cache lends its free top to an instance placed beside it on its GPU
    (idle memory first; docs/elastic.md), under a lease: `kv_room` the bytes it could lend now,
    `lend_kv` the bytes lent (0: refused), `return_kv` the bytes the lease's lending gave back
    (0: it holds none), `renew_kv_lease` the bytes still lent (SiteRejected: the site holds no
    such lease any more). SiteCallError when a call fails (the site refused it as malformed or
    from a caller other than the gateway, or cannot be reached)."""

    async def kv_room(self) -> int: ...

    async def lend_kv(self, wanted_bytes: int, lease: KvLease) -> int: ...

    async def return_kv(self, lease_id: str) -> int: ...

    async def renew_kv_lease(self, lease: KvLease) -> int: ...


@runtime_checkable
class AdapterArchiveLoading(Protocol):
    """A site that serves an adapter whose files the gateway sends (one tar archive of its
    adapter_config.json and weights: site_engine/adapter_archive.py), as load_adapter serves a
    directory on the site's machine; refused as load_adapter is."""

    async def load_adapter_archive(self, name: str, archive: bytes) -> tuple[str, ...]: ...


@runtime_checkable
class FineTunedAdapterSource(Protocol):
    """A training site that hands over a succeeded job's adapter files (the tar archive
    AdapterArchiveLoading takes); FineTuneCallRefused when it has no such adapter."""

    async def fine_tuned_adapter(self, job_id: str) -> bytes: ...


@runtime_checkable
class FineTuningSite(Protocol):
    """A site that trains LoRA fine-tuning jobs of its model in the cycles inference leaves idle
    (issue 54; it says so in SiteInfoView.accepts_fine_tuning). Each call answers the job's
    progress as the site has it now (fedllm_contract/fine_tuning.py): whole histories, so the
    gateway may ask as often as it likes and lose no report. SiteRejected when the site refuses
    the job (another base, a malformed file) or, asked of a job's progress or cancel, does not
    know the job (lost with its disk); SiteUnavailable when it cannot be reached.

    A start is answered once the site has registered the job (it reads the files afterwards),
    and a site refuses a second start of a job it knows: the client then answers the job's
    progress. `live_fine_tunes` names the jobs the site holds that are not final, so that the
    gateway cancels those it does not hold as live (issue 67)."""

    async def start_fine_tune(self, spec: FineTuneSpec) -> FineTuneProgress: ...

    async def fine_tune_progress(self, job_id: str) -> FineTuneProgress: ...

    async def cancel_fine_tune(self, job_id: str) -> FineTuneProgress: ...

    async def live_fine_tunes(self) -> list[str]: ...
