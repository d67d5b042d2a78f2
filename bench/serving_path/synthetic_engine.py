"""A synthetic token source with the `Engine` protocol (site_engine/engine/core/api.py), for the
serving-path benchmark's CPU mode: the real site around it, no model.

Each step runs every admitted request as one row and gives each row one token, at a set step
period (the step sleeps until it is due: 1,024 rows every 10 ms offer 102k tokens/s, about what
one H200 makes of the 1B shape at full batch; 85k at 256 req/s in issue 74). Waiting requests
are admitted first-come first-served up to `rows` running at the start of a step, a request
finishes with `length` at its max_tokens (EOS never ends it), and the step that admits a request
gives its first token (its prefill's). Tokens are real ids of the site's tokenizer, a request
cycling through the ids of a real text from an offset of its own, so that the site's detokenizer
does the work a real answer gives it.

When the caller falls behind the period (the service's loop between two steps takes longer than
one), steps run back to back without catching up: what the engine offers then is what its caller
lets it, which the site's generated-token counter shows. Stats are kept as running sums, as a
real engine's scheduler keeps them, so that reading them costs no walk over the rows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from fedllm_contract.cache_events import CacheEvent
from site_engine.engine.core.api import (
    AdapterRefused,
    EngineLimits,
    EngineRequest,
    EngineStats,
    RequestRejected,
    StepOutputs,
)
from site_engine.engine.core.types import FinishReason

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Row:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    offset: int  # where in the text its tokens start
    produced: int = 0


class SyntheticEngine:
    """The module docstring's engine. `graphs_pending` is False: site_engine.__main__'s
    start_generation reads it of the engine it builds."""

    graphs_pending = False

    def __init__(
        self,
        rows: int,
        step_s: float,
        token_ids: Sequence[int],
        max_model_len: int,
        block_size: int = 16,
    ) -> None:
        if rows < 1 or step_s < 0 or not token_ids:
            raise ValueError("rows >= 1, step_s >= 0 and some token ids are needed")
        self._rows, self._step_s = rows, step_s
        self._text = tuple(token_ids)
        self._block = block_size
        blocks_per_row = -(-max_model_len // block_size)
        self._limits = EngineLimits(
            max_model_len, block_size, rows * blocks_per_row, rows, "synthetic"
        )
        self._waiting: dict[str, EngineRequest] = {}
        self._running: dict[str, _Row] = {}
        self._due = 0.0
        self._iterations = 0
        self._next_offset = 0
        # Running sums (module docstring).
        self._queued_prompt = 0
        self._running_tokens = 0
        self._remaining = 0
        self._blocks = 0

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    def add_request(self, request: EngineRequest) -> None:
        need = len(request.prompt_token_ids) + request.sampling.max_tokens
        if need > self._limits.max_model_len:
            raise RequestRejected(
                f"{need} tokens do not fit the context of {self._limits.max_model_len}"
            )
        self._waiting[request.request_id] = request
        self._queued_prompt += len(request.prompt_token_ids)
        self._remaining += request.sampling.max_tokens

    def abort(self, request_id: str, reason: FinishReason) -> bool:
        request = self._waiting.pop(request_id, None)
        if request is not None:
            self._queued_prompt -= len(request.prompt_token_ids)
            self._remaining -= request.sampling.max_tokens
            return True
        row = self._running.pop(request_id, None)
        if row is None:
            return False
        self._retire(row)
        return True

    def release_queued(self, max_requests: int) -> list[EngineRequest]:
        released = [r for r in self._waiting.values() if r.releasable][:max_requests]
        for request in released:
            self.abort(request.request_id, FinishReason.RELEASED)
        return released

    def step(self) -> StepOutputs:
        """Admits, waits out the period (the step's compute), then a token for every row: a
        request admitted now gets its first (its prefill's), one that arrives meanwhile waits
        for the next step, as a real engine fixes a step's batch when it starts it."""
        if not self._iterations:  # the bench tells this thread's CPU time by its id
            log.info("synthetic engine thread %d", threading.get_native_id())
        firsts = self._admit()
        self._pace()
        ids: list[str] = []
        tokens: list[int] = []
        done: list[int] = []
        text, size, block = self._text, len(self._text), self._block
        for row in self._running.values():
            ids.append(row.request_id)
            tokens.append(text[(row.offset + row.produced) % size])
            row.produced += 1
            if (row.prompt_tokens + row.produced) % block == 1:
                self._blocks += 1
            if row.produced >= row.max_tokens:
                done.append(len(ids) - 1)
        outputs = StepOutputs()
        outputs.add_rows(ids, tokens, [0] * len(ids))
        outputs.decoded = len(ids) - firsts
        self._running_tokens += len(ids)
        self._remaining -= len(ids)
        for index in done:
            outputs.finish(index, FinishReason.LENGTH)
            self._retire(self._running.pop(ids[index]))
        self._iterations += 1
        return outputs

    def _pace(self) -> None:
        """Sleeps until the step is due; an engine idle or a period behind starts afresh."""
        now = time.monotonic()
        if self._due < now - self._step_s:
            self._due = now
        self._due += self._step_s
        wait = self._due - now
        if wait > 0:
            time.sleep(wait)

    def _admit(self) -> int:
        """Waiting requests into free rows, first come first served; how many."""
        admitted = 0
        while self._waiting and len(self._running) < self._rows:
            request_id = next(iter(self._waiting))
            request = self._waiting.pop(request_id)
            prompt = len(request.prompt_token_ids)
            self._queued_prompt -= prompt
            self._running_tokens += prompt
            self._blocks += -(-prompt // self._block)
            self._running[request_id] = _Row(
                request_id, prompt, request.sampling.max_tokens, self._next_offset
            )
            # Rows start apart in the text, so no two answers are the same.
            self._next_offset = (self._next_offset + 97) % len(self._text)
            admitted += 1
        return admitted

    def _retire(self, row: _Row) -> None:
        self._running_tokens -= row.prompt_tokens + row.produced
        self._remaining -= row.max_tokens - row.produced
        self._blocks -= -(-(row.prompt_tokens + row.produced) // self._block)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            queued_prompt_tokens=self._queued_prompt,
            running_tokens=self._running_tokens,
            predicted_remaining_tokens=self._remaining,
            kv_blocks_used=self._blocks,
            kv_blocks_total=self._limits.kv_blocks_total,
            iterations=self._iterations,
        )

    def queue_lengths(self) -> tuple[int, int]:
        return len(self._waiting), len(self._running)

    def take_cache_events(self) -> list[CacheEvent]:
        return []

    def cache_snapshot(self) -> list[CacheEvent]:
        return []

    def served_adapters(self) -> tuple[str, ...]:
        return ()

    def load_adapter(self, name: str, path: str) -> None:
        raise AdapterRefused(AdapterRefused.BUSY, "the synthetic engine serves no adapters")

    def unload_adapter(self, name: str) -> None:
        raise AdapterRefused(AdapterRefused.BUSY, "the synthetic engine serves no adapters")

    def kv_room(self) -> int:
        return 0

    def lend_kv(self, wanted_bytes: int) -> int:
        return 0

    def return_kv(self) -> int:
        return 0
