"""A one-request-at-a-time engine over transformers' own KV cache.

It is the walking skeleton's engine: real model, real sampling, real streaming, no batching.
The continuous-batching engine over the paged cache replaces it behind the same Engine protocol.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from site_engine.engine.api import (
    EngineLimits,
    EngineRequest,
    EngineStats,
    RequestOutput,
    RequestRejected,
)
from site_engine.engine.types import FinishReason, SamplingParams
from site_engine.model_loading import LoadedModel


@dataclass(slots=True)
class _Active:
    request: EngineRequest
    generated: list[int]
    cache: DynamicCache
    generator: torch.Generator | None


def sample_next(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> int:
    """Picks one token from a [vocab] logits row: greedy, temperature, then top-p."""
    if sampling.greedy:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < sampling.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator).item())


class SequentialEngine:
    def __init__(self, loaded: LoadedModel, name: str = "sequential") -> None:
        self._loaded = loaded
        self._waiting: deque[EngineRequest] = deque()
        self._active: _Active | None = None
        self._iterations = 0
        self._limits = EngineLimits(
            max_model_len=loaded.max_model_len,
            kv_block_size=1,
            kv_blocks_total=loaded.max_model_len,
            max_num_seqs=1,
            name=name,
        )

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    def add_request(self, request: EngineRequest) -> None:
        total = len(request.prompt_token_ids) + request.sampling.max_tokens
        if not request.prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        if total > self._limits.max_model_len:
            raise RequestRejected(
                f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens "
                f"({request.sampling.max_tokens}) exceeds the model's context of "
                f"{self._limits.max_model_len} tokens"
            )
        self._waiting.append(request)

    def abort(self, request_id: str, reason: FinishReason) -> bool:
        if self._active is not None and self._active.request.request_id == request_id:
            self._active = None
            return True
        for queued in self._waiting:
            if queued.request_id == request_id:
                self._waiting.remove(queued)
                return True
        return False

    def release_queued(self, max_requests: int) -> list[EngineRequest]:
        released: list[EngineRequest] = []
        while self._waiting and len(released) < max_requests:
            released.append(self._waiting.pop())  # the tail would wait longest
        return released

    def has_unfinished(self) -> bool:
        return self._active is not None or bool(self._waiting)

    def step(self) -> list[RequestOutput]:
        if self._active is None:
            if not self._waiting:
                return []
            request = self._waiting.popleft()
            seed = request.sampling.seed
            generator = None if seed is None else torch.Generator().manual_seed(seed)
            self._active = _Active(request, [], DynamicCache(), generator)
            inputs = list(request.prompt_token_ids)
        else:
            inputs = [self._active.generated[-1]]
        self._iterations += 1
        return [self._decode_one(self._active, inputs)]

    @torch.inference_mode()
    def _decode_one(self, active: _Active, inputs: list[int]) -> RequestOutput:
        input_ids = torch.tensor([inputs], device=self._loaded.device)
        out = self._loaded.model(input_ids=input_ids, past_key_values=active.cache, use_cache=True)
        active.cache = out.past_key_values
        token = sample_next(out.logits[0, -1], active.request.sampling, active.generator)
        active.generated.append(token)
        sampling = active.request.sampling
        finish: FinishReason | None = None
        if token in self._loaded.eos_token_ids and not sampling.ignore_eos:
            finish = FinishReason.STOP
        elif len(active.generated) >= sampling.max_tokens:
            finish = FinishReason.LENGTH
        if finish is not None:
            self._active = None
        return RequestOutput(active.request.request_id, (token,), finish)

    def stats(self) -> EngineStats:
        active = self._active
        running_tokens = 0
        remaining = sum(r.predicted_tokens or r.sampling.max_tokens for r in self._waiting)
        if active is not None:
            running_tokens = len(active.request.prompt_token_ids) + len(active.generated)
            expected = active.request.predicted_tokens or active.request.sampling.max_tokens
            remaining += max(0, expected - len(active.generated))
        return EngineStats(
            num_waiting=len(self._waiting),
            num_running=int(active is not None),
            queued_prompt_tokens=sum(len(r.prompt_token_ids) for r in self._waiting),
            running_tokens=running_tokens,
            predicted_remaining_tokens=remaining,
            kv_blocks_used=running_tokens,
            kv_blocks_total=self._limits.kv_blocks_total,
            iterations=self._iterations,
        )
