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

from site_engine.engine.types import PENDING_TOKEN, ModelRunnerOutput, ScheduledChunk


@dataclass(frozen=True, slots=True)
class LaunchedStep:
    rows: dict[str, int]  # request id -> row of `sampled`, in row order
    sampled: torch.Tensor | None  # [N] int64 on the model's device; None if nothing was sampled
    host: torch.Tensor | None = None  # pinned copy of `sampled` (CUDA), filled asynchronously
    ready: torch.cuda.Event | None = None  # recorded after that copy

    @classmethod
    def nothing_sampled(cls) -> LaunchedStep:
        return cls(rows={}, sampled=None)

    @classmethod
    def start(cls, chunks: Sequence[ScheduledChunk], sampled: torch.Tensor) -> LaunchedStep:
        """Queue the device-to-host copy of `sampled` (one row per chunk) behind the step."""
        rows = {chunk.request_id: row for row, chunk in enumerate(chunks)}
        if sampled.device.type != "cuda":
            return cls(rows=rows, sampled=sampled)
        host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        host.copy_(sampled, non_blocking=True)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()
        return cls(rows=rows, sampled=sampled, host=host, ready=ready)

    def result(self) -> ModelRunnerOutput:
        """The sampled token of every sampled chunk; waits for the device if it must."""
        if self.sampled is None:
            return ModelRunnerOutput(sampled_token_ids={})
        if self.ready is not None:
            self.ready.synchronize()
        values = (self.host if self.host is not None else self.sampled).tolist()
        return ModelRunnerOutput(sampled_token_ids=dict(zip(self.rows, values, strict=True)))

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
