"""The scheduler's mutable record of one request, and what each step reports about it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fedllm_contract.block_hash import block_hashes, chain_hash
from fedllm_contract.priority import Priority
from site_engine.engine.core.outputs import RequestOutput
from site_engine.engine.core.remaining import remaining_tokens
from site_engine.engine.core.types import PENDING_TOKEN, FinishReason, Guide, SamplingParams

if TYPE_CHECKING:
    from site_engine.engine.core.running_batch import RunningBatch


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life: queued, holding KV blocks, or gone."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# eq=False: sequences are identities held in several queues; two requests with equal fields are
# still different requests.
@dataclass(slots=True, eq=False)
class Sequence:
    """One request as the scheduler sees it.

    `num_computed_tokens` counts the leading positions whose KV entries are in the paged cache or
    being written by a step already scheduled; a recompute preemption resets it to 0 but keeps
    `output_token_ids`, so the sequence re-prefills prompt + generated tokens when it comes back.
    `num_pending` counts tokens sampled by scheduled steps whose values the host does not know yet
    (async scheduling runs step N+1 before step N's tokens reach the host); they follow
    `output_token_ids` in position order.
    `predicted_tokens` is the gateway's prediction of the response length (None: no prediction).
    Prefix caching: `root_hash` seeds the ids of its blocks (model and cache salt,
    fedllm_contract/block_hash.py), `block_hashes` holds the ids of its full blocks of known
    tokens computed so far (extended block by block, each new id chained from the last one, so
    a block is hashed once in the sequence's life), and `num_cached_prompt_tokens` the prompt
    tokens its first admission found cached (the client's usage reports them).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    predicted_tokens: int | None = None
    arrival_index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    # num_computed_tokens, num_pending and next_full_block_at while it waits or has left; while
    # it runs its row of the running batch holds them (the properties below read it).
    _computed: int = 0
    _pending: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    ever_scheduled: bool = False
    cache_salt: str = ""
    root_hash: int = 0
    block_hashes: list[int] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0
    # Computed tokens from which its next block may be full and newly indexable: below that,
    # `update` skips the sequence (SequenceCache sets it): next_full_block_at.
    _next_full: int = 0
    # The grammar its answer must follow (constrained decoding), advanced token by token;
    # `awaiting_guide` while that grammar is still being compiled (it is not admitted).
    guide: Guide | None = None
    awaiting_guide: bool = False
    # Why it failed, with FinishReason.ERROR.
    error: str = ""
    # False for one choice of a request with several: offload never splits such a request.
    releasable: bool = True
    # Its class: admitted before lower classes, preempted for higher ones (scheduling/).
    priority: Priority = Priority.INTERACTIVE
    # Its LoRA adapter ("": the base model), a key of its block ids (see root_hash);
    # `awaiting_adapter` while the adapter is loading into host memory (it is not admitted).
    adapter: str = ""
    awaiting_adapter: bool = False
    # The step at which it first found every adapter slot taken (-1: never): how long later
    # requests of the running adapters have overtaken it (scheduling/adapter_gate.py,
    # adapter_slots.py).
    slot_wait_since: int = -1
    # Its row of the running batch while it runs (running_batch.py), else None and -1.
    _batch: RunningBatch | None = field(default=None, repr=False)
    _row: int = -1

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt is empty")
        if self.predicted_tokens is not None and self.predicted_tokens < 0:
            raise ValueError(
                f"request {self.request_id!r}: predicted_tokens must be >= 0 or None, "
                f"got {self.predicted_tokens}"
            )

    @property
    def num_computed_tokens(self) -> int:
        """Leading positions whose KV is in the cache or written by a scheduled step."""
        batch = self._batch
        return self._computed if batch is None else int(batch.computed[self._row])

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        batch = self._batch
        if batch is None:
            self._computed = value
        else:
            batch.computed[self._row] = value

    @property
    def num_pending(self) -> int:
        """Tokens sampled by scheduled steps whose values the host does not know yet."""
        batch = self._batch
        return self._pending if batch is None else int(batch.pending[self._row])

    @num_pending.setter
    def num_pending(self, value: int) -> None:
        batch = self._batch
        if batch is None:
            self._pending = value
        else:
            # The row's token count moves with it only where the scheduler says so: a token
            # sampled (pending + 1) adds one, one resolved (pending - 1, the answer + 1) none.
            batch.pending[self._row] = value

    @property
    def next_full_block_at(self) -> int:
        batch = self._batch
        return self._next_full if batch is None else int(batch.next_full[self._row])

    @next_full_block_at.setter
    def next_full_block_at(self, value: int) -> None:
        batch = self._batch
        if batch is None:
            self._next_full = value
        else:
            batch.next_full[self._row] = value

    @property
    def row(self) -> int:
        """Its row of the running batch, -1 unless it runs."""
        return self._row

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far, known or pending."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.num_output_tokens

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        """Every position's token; PENDING_TOKEN where the value is still on the device."""
        return (
            self.prompt_token_ids
            + tuple(self.output_token_ids)
            + (PENDING_TOKEN,) * self.num_pending
        )

    @property
    def generation_done(self) -> bool:
        """Every token it may produce is sampled (max_tokens reached), some maybe still pending."""
        return self.num_output_tokens >= self.sampling.max_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens whose KV is not in the cache yet (1 for a decoding sequence)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def expected_output_tokens(self) -> int:
        """The response length the scheduler plans for.

        A prediction is clamped to [1, max_tokens]: every request yields at least one token and
        max_tokens is a hard cap, so planning outside that range would only be wrong.
        """
        max_tokens = self.sampling.max_tokens
        if self.predicted_tokens is None:
            return max_tokens
        return min(max(self.predicted_tokens, 1), max_tokens)

    @property
    def expected_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.expected_output_tokens

    @property
    def remaining_predicted_tokens(self) -> int:
        """Output tokens still expected (site_engine/engine/core/remaining.py); 0 once finished."""
        if self.is_finished:
            return 0
        return remaining_tokens(
            self.expected_output_tokens, self.num_output_tokens, self.sampling.max_tokens
        )

    def full_block_hashes(self, block_size: int, num_blocks: int) -> list[int]:
        """The ids of the first `num_blocks` blocks (their tokens must be known), extending the
        ones computed before; the list returned is the sequence's own, not a copy."""
        hashes = self.block_hashes
        done = len(hashes)
        if num_blocks == done + 1:
            # The common case (a decoding sequence filled one block): one hash, chained from
            # the id kept from before, nothing else recomputed; a block of known answer tokens
            # is read from the answer's list without a copy of the rest.
            start = done * block_size - len(self.prompt_token_ids)
            output = self.output_token_ids
            if start >= 0 and start + block_size <= len(output):
                tokens: list[int] | tuple[int, ...] = output[start : start + block_size]
            else:
                tokens = self.token_ids_between(done * block_size, num_blocks * block_size)
                assert PENDING_TOKEN not in tokens, "a block id needs every token of the block"
            hashes.append(chain_hash(hashes[-1] if done else self.root_hash, tokens))
        elif num_blocks > done:
            tokens = self.token_ids_between(done * block_size, num_blocks * block_size)
            assert PENDING_TOKEN not in tokens, "a block id needs every token of the block"
            parent = hashes[-1] if done else self.root_hash
            hashes.extend(block_hashes(tokens, block_size, parent))
        return hashes

    @property
    def num_known_tokens(self) -> int:
        """Prompt and generated tokens whose values the host knows."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_between(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens at positions [start, end) of prompt + output, without copying the whole seq;
        PENDING_TOKEN for positions whose token is still on the device."""
        num_prompt = self.num_prompt_tokens
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        known_end = num_prompt + len(self.output_token_ids)
        if end > known_end:
            return self.token_ids_between(start, known_end) + (PENDING_TOKEN,) * (
                end - max(start, known_end)
            )
        if start >= num_prompt:
            return tuple(self.output_token_ids[start - num_prompt : end - num_prompt])
        return self.prompt_token_ids[start:] + tuple(self.output_token_ids[: end - num_prompt])


# What one step did to one sequence: the tokens it gained and whether it finished. The engine's
# RequestOutput itself (core/outputs.py): the scheduler's update hands out the engine's outputs.
SequenceUpdate = RequestOutput
