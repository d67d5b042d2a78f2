"""A step whose device work is queued but whose sampled tokens the host has not read yet.

Reading sampled tokens on the host waits for the device. Async scheduling defers that read: the
engine schedules and launches step N+1 first (its decode chunks take their pending input tokens
straight from step N's `sampled` tensor on the device), then reads step N's tokens, which by then
have been copied into pinned memory behind the device work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from site_engine.engine.core.types import (
    PENDING_TOKEN,
    ModelRunnerOutput,
    ScheduledChunk,
    TokenLogprob,
)
from site_engine.engine.sampler import SampledTokens


def _to_host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A pinned host copy of a device tensor, queued behind the step (None stays None)."""
    if tensor is None or tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


@dataclass(frozen=True, slots=True)
class LaunchedStep:
    rows: dict[str, int]  # request id -> row of `sampled`, in row order
    sampled: torch.Tensor | None  # [N] int64 on the model's device; None if nothing was sampled
    host: torch.Tensor | None = None  # pinned copy of `sampled` (CUDA), filled asynchronously
    ready: torch.cuda.Event | None = None  # recorded after that copy
    # Logprobs of the rows that asked (host copies, filled with `host`): the sampled token's,
    # and the top alternatives' ids and values.
    logprobs: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None = None
    wants_logprobs: tuple[int, ...] = ()  # the rows that asked, and how many alternatives
    top_counts: tuple[int, ...] = ()

    @classmethod
    def nothing_sampled(cls) -> LaunchedStep:
        return cls(rows={}, sampled=None)

    @classmethod
    def start(
        cls, chunks: Sequence[ScheduledChunk], sampled: torch.Tensor | SampledTokens
    ) -> LaunchedStep:
        """Queue the device-to-host copy of the samples (one row per chunk) behind the step."""
        tokens = sampled if isinstance(sampled, SampledTokens) else SampledTokens(sampled)
        rows = {chunk.request_id: row for row, chunk in enumerate(chunks)}
        logprobs = None
        wants: tuple[int, ...] = ()
        tops: tuple[int, ...] = ()
        if tokens.logprobs is not None:
            wants = tuple(row for row, c in enumerate(chunks) if c.sampling.logprobs)
            tops = tuple(chunks[row].sampling.top_logprobs for row in wants)
            logprobs = (
                _to_host(tokens.logprobs),
                _to_host(tokens.top_ids),
                _to_host(tokens.top_logprobs),
            )
        ids = tokens.ids
        if ids.device.type != "cuda":
            return cls(rows, ids, logprobs=logprobs, wants_logprobs=wants, top_counts=tops)
        host = _to_host(ids)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()
        return cls(rows, ids, host, ready, logprobs, wants, tops)

    def result(self) -> ModelRunnerOutput:
        """The sampled token of every sampled chunk; waits for the device if it must."""
        if self.sampled is None:
            return ModelRunnerOutput(sampled_token_ids={})
        if self.ready is not None:
            self.ready.synchronize()
        values = (self.host if self.host is not None else self.sampled).tolist()
        ids = dict(zip(self.rows, values, strict=True))
        return ModelRunnerOutput(sampled_token_ids=ids, logprobs=self._logprobs())

    def _logprobs(self) -> dict[str, TokenLogprob]:
        if self.logprobs is None or not self.wants_logprobs:
            return {}
        chosen, top_ids, top_values = self.logprobs
        if chosen is None:
            return {}
        names = list(self.rows)
        chosen_list = chosen.tolist()
        ids_list = top_ids.tolist() if top_ids is not None else None
        values_list = top_values.tolist() if top_values is not None else None
        out: dict[str, TokenLogprob] = {}
        for row, count in zip(self.wants_logprobs, self.top_counts, strict=True):
            top: tuple[tuple[int, float], ...] = ()
            if count and ids_list is not None and values_list is not None:
                top = tuple(zip(ids_list[row][:count], values_list[row][:count], strict=True))
            out[names[row]] = TokenLogprob(chosen_list[row], top)
        return out

    def pending_rows(self, chunks: Sequence[ScheduledChunk]) -> list[int]:
        """Per chunk: the row of `sampled` its pending input token comes from, or -1."""
        rows: list[int] = []
        for chunk in chunks:
            if PENDING_TOKEN not in chunk.token_ids:
                rows.append(-1)
                continue
            row = self.rows.get(chunk.request_id)
            if chunk.token_ids != (PENDING_TOKEN,) or row is None or self.sampled is None:
                raise ValueError(
                    f"request {chunk.request_id!r}: a pending input token must be the only token "
                    "of a decode chunk whose sequence sampled in the previous step"
                )
            rows.append(row)
        return rows


def no_pending_rows(chunks: Sequence[ScheduledChunk]) -> list[int]:
    """pending_rows() for a step launched without a previous one: pending tokens are an error."""
    for chunk in chunks:
        if PENDING_TOKEN in chunk.token_ids:
            raise ValueError(
                f"request {chunk.request_id!r} has a pending input token but no previous step "
                "was given to take it from"
            )
    return [-1] * len(chunks)
