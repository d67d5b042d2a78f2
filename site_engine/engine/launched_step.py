"""A step whose device work is queued but whose sampled tokens the host has not read yet.

Reading sampled tokens on the host waits for the device. Async scheduling defers that read: the
engine schedules and launches step N+1 first (its decode rows take their input tokens from the
model runner's per-row last tokens on the device, which step N's sampling wrote), then reads
step N's tokens, which by then have been copied into pinned memory behind the device work.
The tokens come back as one array in the step's sample order (SchedulerOutput: decode rows, then
the sampling prefill chunks); logprobs only for the rows that asked, by request id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from site_engine.engine.core.types import ModelRunnerOutput, ScheduledChunk, TokenLogprob
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
    sampled: torch.Tensor | None  # [N] int64 on the model's device; None if nothing was sampled
    host: torch.Tensor | None = None  # pinned copy of `sampled` (CUDA), filled asynchronously
    ready: torch.cuda.Event | None = None  # recorded after that copy
    # Logprobs of the rows that asked (host copies, filled with `host`): the sampled token's,
    # and the top alternatives' ids and values; `asking` names those rows (sample index, chunk).
    logprobs: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None = None
    asking: tuple[tuple[int, ScheduledChunk], ...] = ()

    @classmethod
    def nothing_sampled(cls) -> LaunchedStep:
        return cls(sampled=None)

    @classmethod
    def start(
        cls, special: Sequence[tuple[int, ScheduledChunk]], sampled: torch.Tensor | SampledTokens
    ) -> LaunchedStep:
        """Queue the device-to-host copy of the samples behind the step."""
        tokens = sampled if isinstance(sampled, SampledTokens) else SampledTokens(sampled)
        logprobs = None
        asking: tuple[tuple[int, ScheduledChunk], ...] = ()
        if tokens.logprobs is not None:
            chunk_of = dict(special)
            asking = tuple((row, chunk_of[row]) for row in tokens.logprob_rows)
            logprobs = (
                _to_host(tokens.logprobs),
                _to_host(tokens.top_ids),
                _to_host(tokens.top_logprobs),
            )
        ids = tokens.ids
        if ids.device.type != "cuda":
            return cls(ids, logprobs=logprobs, asking=asking)
        host = _to_host(ids)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()
        return cls(ids, host, ready, logprobs, asking)

    def result(self) -> ModelRunnerOutput:
        """The sampled token of every sampled row, in sample order; waits for the device."""
        if self.sampled is None:
            return ModelRunnerOutput(tokens=np.zeros(0, dtype=np.int64))
        if self.ready is not None:
            self.ready.synchronize()
        tokens = (self.host if self.host is not None else self.sampled).numpy()
        return ModelRunnerOutput(tokens=tokens, logprobs=self._logprobs())

    def _logprobs(self) -> dict[str, TokenLogprob]:
        if self.logprobs is None or not self.asking:
            return {}
        chosen, top_ids, top_values = self.logprobs
        if chosen is None:
            return {}
        chosen_list = chosen.tolist()
        ids_list = top_ids.tolist() if top_ids is not None else None
        values_list = top_values.tolist() if top_values is not None else None
        out: dict[str, TokenLogprob] = {}
        for at, (_, chunk) in enumerate(self.asking):
            count = chunk.sampling.top_logprobs
            top: tuple[tuple[int, float], ...] = ()
            if count and ids_list is not None and values_list is not None:
                top = tuple(zip(ids_list[at][:count], values_list[at][:count], strict=True))
            out[chunk.request_id] = TokenLogprob(chosen_list[at], top)
        return out
