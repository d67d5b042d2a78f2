"""Token sampling for one step: greedy, temperature, top-p, and per-request seeds.

Sampling uses the exponential-race trick: argmax(p / E) with E ~ Exp(1) i.i.d. draws token i
with probability p_i. That turns the whole batch into one vectorised argmax, and a seeded row
only needs its own noise row, drawn from its own generator.

A seeded request's generator is re-seeded every step from (seed, num_generated) rather than
carried along: the stream then depends only on the request, so it survives preemption and
recompute, and does not change with the batch the request happens to share.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch

from site_engine.engine.core.types import ScheduledChunk
from site_engine.engine.host_staging import HostStaging
from site_engine.engine.logit_processing import (
    GrammarMasks,
    apply_grammar_masks,
    apply_logit_bias,
    apply_penalties,
    prepare_grammar_masks,
)

if TYPE_CHECKING:
    from site_engine.engine.structured_output import MaskFiller

_MASK64 = (1 << 64) - 1
# Temperatures below this sample as if they were this: already argmax in practice, and logits
# divided by a smaller one can overflow float32 to inf, whose softmax is NaN (token 0 wins).
MIN_TEMPERATURE = 1e-4


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, num_generated: int) -> int:
    """Seed of a seeded request's random stream for the step that samples token `num_generated`.

    Hashing (rather than seed + step) keeps the streams of nearby seeds and steps unrelated.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ num_generated) >> 1  # torch wants < 2**63


def apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside each row's nucleus (not renormalised: argmax does not care).

    A token is kept while the mass of the more likely tokens before it is below top_p, so the
    most likely token always survives.
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p.unsqueeze(1), 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


@dataclass(frozen=True, slots=True)
class SampleSpec:
    """What sampling a step's N rows reads: each row's temperature, top-p and answer tokens so
    far (a seeded row's step), and the rows that need more than the vectorized path (logit bias,
    penalties, a grammar, logprobs, a seed) as (row, chunk)."""

    temperature: npt.NDArray[np.float32]
    top_p: npt.NDArray[np.float32]
    generated: npt.NDArray[np.int64]
    special: tuple[tuple[int, ScheduledChunk], ...] = ()

    @classmethod
    def of_chunks(cls, chunks: Sequence[ScheduledChunk]) -> SampleSpec:
        """One row per chunk, every chunk's sampling as it says (tests, tools)."""
        return cls(
            np.array([c.sampling.temperature for c in chunks], dtype=np.float32),
            np.array([c.sampling.top_p for c in chunks], dtype=np.float32),
            np.array([c.num_generated for c in chunks], dtype=np.int64),
            tuple((i, c) for i, c in enumerate(chunks) if not _plain(c)),
        )

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def greedy(self) -> bool:
        return not bool((self.temperature > 0).any())


def _spec(rows: SampleSpec | Sequence[ScheduledChunk]) -> SampleSpec:
    return rows if isinstance(rows, SampleSpec) else SampleSpec.of_chunks(rows)


def _plain(chunk: ScheduledChunk) -> bool:
    sampling = chunk.sampling
    return sampling.plain and (sampling.seed is None or sampling.greedy)


@dataclass(frozen=True, slots=True)
class SampledTokens:
    """One step's samples, on the logits' device: a token id per row and, for the rows that
    asked for logprobs (`logprob_rows`), the sampled token's log probability and the top
    alternatives."""

    ids: torch.Tensor  # [N] int64
    logprob_rows: tuple[int, ...] = ()
    logprobs: torch.Tensor | None = None  # [L] float32
    top_ids: torch.Tensor | None = None  # [L, k] int64, k = the largest top_logprobs asked
    top_logprobs: torch.Tensor | None = None  # [L, k] float32


def _logprobs(raw: torch.Tensor, ids: torch.Tensor, asking: Sequence[tuple[int, ScheduledChunk]],
              staging: HostStaging) -> SampledTokens:  # fmt: skip
    """Log probabilities as OpenAI and vLLM report them: float32 log-softmax of the raw logits
    (before bias, penalties, masks and temperature), of the rows that asked only."""
    rows = [row for row, _ in asking]
    index = staging.values("logprob rows", rows, torch.long)
    logprobs = torch.log_softmax(raw.index_select(0, index).float(), dim=-1)
    chosen = logprobs.gather(1, ids.index_select(0, index).unsqueeze(1)).squeeze(1)
    k = max(chunk.sampling.top_logprobs for _, chunk in asking)
    if k == 0:
        return SampledTokens(ids, tuple(rows), chosen)
    top = logprobs.topk(k, dim=-1)
    return SampledTokens(ids, tuple(rows), chosen, top.indices, top.values)


class Sampler:
    """Samples one token per row of float32 logits, following each row's sampling parameters.

    `generator` drives unseeded rows (the global RNG when None); tests pass one for repeatability.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self._generator = generator
        # Reused Generator objects of seeded requests, to avoid allocating one per step.
        self._seeded: dict[str, torch.Generator] = {}
        self._staging: dict[torch.device, HostStaging] = {}
        self._filler: MaskFiller | None = None  # started by the first background fill

    def prepare_masks(
        self,
        rows: SampleSpec | Sequence[ScheduledChunk],
        vocab: int,
        device: torch.device,
        background: bool = False,
    ) -> GrammarMasks | None:
        """The grammar masks `sample_step` will apply to these rows (a SampleSpec, or one row
        per chunk); with `background` they fill on a thread of their own while the caller does
        other host work."""
        spec = _spec(rows)
        if not any(chunk.guide is not None for _, chunk in spec.special):
            return None
        if background and self._filler is None:
            from site_engine.engine.structured_output import MaskFiller

            self._filler = MaskFiller()
        filler = self._filler if background else None
        return prepare_grammar_masks(spec.special, vocab, self._staging_for(device), filler)

    def close(self) -> None:
        """Stops the mask filler's thread, if one was started."""
        if self._filler is not None:
            self._filler.close()
            self._filler = None

    def _staging_for(self, device: torch.device) -> HostStaging:
        if device.type == "cuda" and device.index is None:
            # One staging per GPU, whether it is named "cuda" (the runner) or "cuda:0" (logits).
            device = torch.device("cuda", torch.cuda.current_device())
        staging = self._staging.get(device)
        if staging is None:
            staging = self._staging[device] = HostStaging(device)
        return staging

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop per-request state of requests that left the engine."""
        for request_id in request_ids:
            self._seeded.pop(request_id, None)

    @property
    def num_tracked_requests(self) -> int:
        return len(self._seeded)

    def sample(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> list[int]:
        """logits: [N, vocab] float32, row i for chunks[i] -> N token ids."""
        return [int(t) for t in self.sample_tensor(logits, chunks).tolist()]

    def sample_tensor(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Like `sample`, but the N token ids stay on the logits' device (int64): no sync, so
        the next step can be launched before the host knows them."""
        return self.sample_step(logits, SampleSpec.of_chunks(chunks)).ids

    def sample_step(
        self,
        logits: torch.Tensor,
        rows: SampleSpec | Sequence[ScheduledChunk],
        masks: GrammarMasks | None = None,
    ) -> SampledTokens:
        """Samples every row (a SampleSpec, or one row per chunk); the special rows that ask for
        logit processing (bias, penalties, a grammar) get it first, and logprobs where they ask
        for them. A step of plain rows takes the vectorized path alone. `masks`: the constrained
        rows' masks from `prepare_masks`, else they are filled here."""
        spec = _spec(rows)
        if logits.shape[0] != spec.num_rows:
            raise ValueError(f"{logits.shape[0]} logit rows for {spec.num_rows} rows")
        special = spec.special
        if not special:
            return SampledTokens(self._sample(logits, spec))
        processing = [(row, c) for row, c in special if not c.sampling.plain]
        processed = logits
        if processing:
            # The raw logits stay as they are (logprobs, graph buffers).
            processed = logits.clone()
            staging = self._staging_for(logits.device)
            apply_logit_bias(processed, processing, staging)
            apply_penalties(processed, processing, staging)
            apply_grammar_masks(processed, processing, staging, masks)
        ids = self._sample(processed, spec)
        asking = [(row, c) for row, c in special if c.sampling.logprobs]
        if not asking:
            return SampledTokens(ids)
        return _logprobs(logits, ids, asking, self._staging_for(logits.device))

    def _sample(self, logits: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        greedy_ids = logits.argmax(dim=-1)
        if spec.greedy:
            return greedy_ids
        device = logits.device
        staging = self._staging_for(device)
        temperature = staging.values("temperature", spec.temperature, logits.dtype)
        is_greedy = temperature == 0.0
        # Greedy rows take argmax of the raw logits below; dividing them by 1 keeps them finite.
        divisor = torch.where(is_greedy, torch.ones_like(temperature), temperature)
        divisor = divisor.clamp_min(MIN_TEMPERATURE)
        probs = torch.softmax(logits / divisor.unsqueeze(1), dim=-1)
        if bool((spec.top_p < 1.0).any()):
            top_p = staging.values("top_p", spec.top_p, logits.dtype)
            probs = apply_top_p(probs, top_p)
        noise = self._exponential_noise(probs, spec)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(is_greedy, greedy_ids, sampled)

    def _exponential_noise(self, probs: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self._generator)
        for row, chunk in spec.special:
            seed = chunk.sampling.seed
            if seed is None or chunk.sampling.greedy:
                continue
            generator = self._seeded.get(chunk.request_id)
            if generator is None:
                generator = torch.Generator(device=probs.device)
                self._seeded[chunk.request_id] = generator
            # A continuation's steps count on from the tokens generated before it (elsewhere).
            steps = chunk.sampling.generated_before + int(spec.generated[row])
            generator.manual_seed(step_seed(seed, steps))
            noise[row].exponential_(generator=generator)
        # An exact 0 draw would turn p / E into inf (or nan for p == 0) and win the argmax.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)
