"""Plain typed objects exchanged between the scheduler and the model runner.

This module is the contract of the engine step (schedule -> run model -> update). It imports no
torch: the scheduler and the KV-block bookkeeping are Python and numpy, unit-tested without a
model, and the model runner consumes these objects without knowing how they were decided.

A step is told to the model runner as what changed (issue 66): the rows that joined the batch,
the blocks added to rows' tables, the prefill chunks, and the decode rows as arrays. A decoding
sequence costs a step no Python object: the runner keeps every row's block table and last sampled
token itself, and reads the decode rows' positions from one array.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from fedllm_contract.grammar import ConstraintSpec

if TYPE_CHECKING:
    from site_engine.engine.core.sequence import Sequence as SchedSequence

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def _no_rows() -> IntArray:
    return np.zeros(0, dtype=np.int64)


def _no_flags() -> BoolArray:
    return np.zeros(0, dtype=np.bool_)


# A token id the host does not know yet: the token its sequence sampled in the step still running
# on the device (async scheduling). The model runner reads it from that step's sampled tokens.
PENDING_TOKEN = -1


class FinishReason(enum.Enum):
    """Why a sequence left the engine."""

    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_tokens reached, or the model's context is full
    CANCELLED = "cancelled"  # the client (or the gateway) cancelled it
    RELEASED = "released"  # handed back before it started, to be offloaded to another site
    # Its constraint failed it: its grammar could not be compiled (in time), or the grammar
    # engine gave up on the answer midway. RequestOutput.error says why; the client gets an
    # error, never the answer as if it were complete.
    ERROR = "error"


MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log probability of one sampled token (float32 log-softmax of the raw logits), and the
    most likely tokens at its position as (token id, log probability), most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Guide(Protocol):
    """A request's grammar state: which tokens may come next. The scheduler advances it with each
    token in `update`; the sampler reads its mask before sampling the next one."""

    def consume(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""

    def fill_mask(self, words: object) -> None:
        """Write the allowed next tokens into `words` (a writable int32 buffer, one bit per
        token id) ."""

    def is_finished(self) -> bool:
        """The answer is complete: nothing but the end may follow."""

    @property
    def error(self) -> str:
        """Why the grammar refused a token ('' while it follows the answer)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next token of one request.

    temperature == 0 means greedy. top_p in (0, 1]. A seed makes sampling reproducible for that
    request regardless of what else shares the batch. Penalties follow OpenAI (presence,
    frequency: on answer tokens, in [-2, 2]) and vLLM (repetition: > 0, 1 is off, on prompt and
    answer tokens); logit_bias adds to the logits of token ids; logprobs reports each sampled
    token's log probability and top_logprobs alternatives; a constraint restricts every token to
    what its grammar allows.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Answer tokens generated elsewhere before this request (a continuation whose prompt ends
    # with them): a seeded sampler's step count starts here, so the answer stays reproducible.
    generated_before: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    constraint: ConstraintSpec | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):  # NaN fails both
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.generated_before < 0:
            raise ValueError(f"generated_before must be >= 0, got {self.generated_before}")
        self._check_logit_processing()

    def _check_logit_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # NaN fails too
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias takes token ids >= 0 and biases in [-100, 100], "
                    f"got {token}: {bias}"
                )
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far (penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def plain(self) -> bool:
        """Nothing but temperature, top-p and seed: the sampler's fast path."""
        return not (
            self.penalized or self.logit_bias or self.logprobs or self.constraint is not None
        )


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request with n choices: choice 0 keeps the request's, so
    n=1 answers as before; the others get unrelated streams of their own."""
    if seed is None or index == 0:
        return seed
    mixed = (seed ^ (index * 0x9E3779B97F4A7C15)) & ((1 << 64) - 1)
    return mixed >> 1  # torch wants < 2**63


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """The tokens of one sequence that the model runner must compute in this step.

    `token_ids` are the tokens whose KV entries are written this step at positions
    `start_position .. start_position + len(token_ids) - 1`: a whole prompt or a prompt chunk
    (prefill, also after a recompute preemption, when it covers prompt + tokens generated so far),
    or the single last generated token (decode). Earlier positions are already in the paged cache.
    With async scheduling the last generated token may still be on the device: a decode chunk's
    only token is then PENDING_TOKEN and the runner takes it from the previous step's samples.
    `block_table` lists the physical KV blocks of the sequence in order; it covers every position
    up to the last one computed this step. `sample` is False for a prefill chunk that does not
    reach the end of the known tokens (chunked prefill): its logits are not needed.
    `num_generated` counts the tokens generated so far (known or pending), so that a seeded
    sampler can derive a per-step random stream that does not depend on the batch the sequence
    shares. `row` is the sequence's row of the running batch (running_batch.py), which the
    model runner keys its per-row state by.

    A step's decode rows are not chunks (SchedulerOutput.decode_rows); `SchedulerOutput.chunks`
    still makes one for each of them, for tests and tools that read a step whole.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_table: tuple[int, ...]
    sample: bool
    sampling: SamplingParams
    num_generated: int
    # What the sampler reads besides the logits, for requests that need it: the grammar state
    # and the answer's known tokens (both the sequence's own objects, advanced by the
    # scheduler's update, so a sampler that runs after the previous step's update sees them
    # whole) and the prompt (repetition penalty).
    guide: Guide | None = None
    history: Sequence[int] = ()
    prompt_token_ids: tuple[int, ...] = ()
    # The LoRA adapter whose deltas its rows add ("": the base model).
    adapter: str = ""
    row: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_tokens > 1 or self.num_generated == 0


@dataclass(frozen=True, slots=True)
class RowJoin:
    """A sequence took a row of the running batch (admitted, or admitted again after a
    preemption): what the model runner keeps of it for as long as it holds the row. `history`
    is the sequence's own answer list (the scheduler appends to it; penalties read it)."""

    row: int
    request_id: str
    sampling: SamplingParams
    adapter: str = ""
    guide: Guide | None = None
    history: Sequence[int] = ()
    prompt_token_ids: tuple[int, ...] = ()

    @property
    def plain(self) -> bool:
        """Sampled by the batch's vectorized path alone: no logit processing, no logprobs, no
        seed (a seeded row draws its own noise)."""
        return self.sampling.plain and (self.sampling.seed is None or self.sampling.greedy)


@dataclass(frozen=True, slots=True)
class KvCopy:
    """One KV block copied between the device cache and the host tier's pool (prefix caching):
    `to_host` copies device block `block` into host slot `slot`, else slot into block."""

    to_host: bool
    block: int
    slot: int


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """Everything the model runner needs for one step, and nothing it must decide itself.

    The step is one flat batch: its decode rows (`decode_rows`, one token each, whose input is
    the token the row sampled last, kept on the device by the runner), then its `prefill_chunks`
    (prompts, prompt chunks, recomputes: every token known), in that order; the sampled rows are
    the decode rows, then the prefill chunks with `sample`, in that order (the order
    ModelRunnerOutput.tokens follows). Per decode row: its `decode_positions` (the position it
    computes), `decode_generated` (answer tokens before this one: a seeded sampler's step),
    `decode_serials` (its row's occupant when planned) and `decode_seqs`. `joined` lists the rows
    taken since the previous step and `table_delta` the blocks added to rows' tables (the
    runner keeps every row's table); the runner applies both before the step.

    `finished_request_ids` are sequences that left the engine since the previous step (finished,
    cancelled, released, or preempted), so the runner can drop any per-request state it keeps.
    `step_id` numbers the scheduler's steps so that results are applied exactly once and in order.
    `kv_copies` are queued in this order after the work already queued (the last writes of the
    blocks they read); the forward pass must wait for the first `kv_copies_before_step` of them
    (copies back from the host that this step reads); the others (copies ahead of an eviction,
    copies back for sequences that compute from the next step) overlap the step and bind only a
    later one: if `kv_copies_wait_for_step` > 0, the forward pass must also wait for the copies
    listed by that step (if they are still running).
    `num_tokens` and `context_tokens`: the positions the step computes and those its rows read
    (each row's length after the step), the inputs of its cost (core/step_cost.py).
    """

    prefill_chunks: tuple[ScheduledChunk, ...] = ()
    finished_request_ids: frozenset[str] = field(default_factory=frozenset)
    preempted_request_ids: frozenset[str] = field(default_factory=frozenset)
    step_id: int = 0
    kv_copies: tuple[KvCopy, ...] = ()
    kv_copies_before_step: int = 0
    kv_copies_wait_for_step: int = 0
    # What the step computes and reads (its cost's inputs: step_cost.py), summed as scheduled.
    num_tokens: int = 0
    context_tokens: int = 0
    decode_rows: IntArray = field(default_factory=_no_rows)
    decode_positions: IntArray = field(default_factory=_no_rows)
    decode_generated: IntArray = field(default_factory=_no_rows)
    decode_serials: IntArray = field(default_factory=_no_rows)
    # For SchedulerOutput.chunks alone: whether the input token was still on the device when
    # planned, and how many blocks the row's table had.
    decode_pending: BoolArray = field(default_factory=_no_flags)
    decode_tables: IntArray = field(default_factory=_no_rows)
    decode_seqs: Sequence[SchedSequence] = ()
    # The serial of each prefill chunk's row when planned (running_batch.py).
    prefill_serials: tuple[int, ...] = ()
    joined: tuple[RowJoin, ...] = ()
    # Blocks appended to rows' tables: (rows, positions in their tables, block ids).
    table_delta: tuple[IntArray, IntArray, IntArray] = field(
        default_factory=lambda: (_no_rows(), _no_rows(), _no_rows())
    )
    # The decode rows whose sampling reads host state (a grammar, penalties), as indices into
    # decode_rows; and each decode row's and prefill chunk's planning key (class, then admission
    # order: SchedulerOutput.chunks sorts by it).
    special_decodes: tuple[int, ...] = ()
    decode_keys: IntArray = field(default_factory=_no_rows)
    prefill_keys: tuple[int, ...] = ()
    # Each running sequence's block table by request id (for `chunks` alone).
    table_of: Callable[[str], tuple[int, ...]] | None = field(default=None, repr=False,
                                                              compare=False)  # fmt: skip
    # Unified adapter slots (core/unified_slots.py): each resident adapter's slot, when that
    # changed since the last step (None: unchanged, or fixed slots); the runner writes the
    # adapters placed anew before the step runs.
    adapter_slots: tuple[tuple[str, int], ...] | None = None
    _materialized: list[ScheduledChunk] = field(default_factory=list, repr=False, compare=False)

    @property
    def num_decodes(self) -> int:
        return int(self.decode_rows.shape[0])

    @property
    def num_batched_tokens(self) -> int:
        return self.num_decodes + sum(chunk.num_tokens for chunk in self.prefill_chunks)

    @property
    def num_sampled(self) -> int:
        return self.num_decodes + sum(1 for chunk in self.prefill_chunks if chunk.sample)

    @property
    def is_empty(self) -> bool:
        return not self.prefill_chunks and not self.num_decodes

    def sample_request_ids(self) -> list[str]:
        """The request id of each sampled row, in sample order."""
        ids = [seq.request_id for seq in self.decode_seqs]
        return ids + [chunk.request_id for chunk in self.prefill_chunks if chunk.sample]

    @property
    def chunks(self) -> Sequence[ScheduledChunk]:
        """Every chunk of the step, decode rows made into chunks too, in the order the
        scheduler planned them (class by class, each in admission order): for tests and tools
        that read a step whole, right after `schedule` (a decode chunk's table and token are
        read from its sequence, as they were when planned). The model runner never calls it."""
        if self._materialized or self.is_empty:
            return tuple(self._materialized)
        table_of = self.table_of or (lambda request_id: ())
        decodes = [
            _decode_chunk(seq, position, generated, pending, table_of(seq.request_id)[:blocks], row)
            for seq, position, generated, pending, blocks, row in zip(
                self.decode_seqs,
                self.decode_positions.tolist(),
                self.decode_generated.tolist(),
                self.decode_pending.tolist(),
                self.decode_tables.tolist(),
                self.decode_rows.tolist(),
                strict=True,
            )
        ]
        every = decodes + list(self.prefill_chunks)
        keys = self.decode_keys.tolist() + list(self.prefill_keys)
        if len(keys) == len(every):
            order = sorted(range(len(every)), key=keys.__getitem__)
            every = [every[i] for i in order]
        self._materialized.extend(every)
        return tuple(every)


def _decode_chunk(
    seq: Any, position: int, generated: int, pending: bool, table: tuple[int, ...], row: int
) -> ScheduledChunk:
    if pending:
        token = PENDING_TOKEN
    else:
        (token,) = seq.token_ids_between(position, position + 1)
    sampling = seq.sampling
    penalized = sampling.penalized
    return ScheduledChunk(
        request_id=seq.request_id,
        token_ids=(token,),
        start_position=position,
        block_table=table,
        sample=True,
        sampling=sampling,
        num_generated=generated,
        guide=seq.guide,
        history=seq.output_token_ids if penalized else (),
        prompt_token_ids=seq.prompt_token_ids if penalized else (),
        adapter=seq.adapter,
        row=row,
    )


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """What one step produced: the sampled token of every sampled row.

    `tokens` follows the step's sample order (SchedulerOutput: decode rows, then the sampling
    prefill chunks); the model runner fills it. `sampled_token_ids` by request id is the same
    for callers without the array (tests, tools): used when `tokens` is None."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # For the requests that asked for logprobs: the sampled token's.
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    tokens: IntArray | None = None
