"""What the GPU benchmark computes from its raw timings: pure Python, no torch.

Times are seconds on one monotonic clock (time.perf_counter) measured from the start of a run;
the summaries report milliseconds.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fedsim.engine_trace import WorkloadRequest, WorkloadSpec


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) with linear interpolation between closest ranks
    (numpy's default "linear" method)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class Distribution:
    """Percentiles of one latency, in milliseconds."""

    count: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float


def distribution_ms(values_s: Iterable[float]) -> Distribution | None:
    """Summary of latencies given in seconds; None when there is none."""
    values = [v * 1000.0 for v in values_s]
    if not values:
        return None
    return Distribution(
        count=len(values),
        mean_ms=statistics.fmean(values),
        p50_ms=percentile(values, 50),
        p90_ms=percentile(values, 90),
        p99_ms=percentile(values, 99),
        max_ms=max(values),
    )


@dataclass(slots=True)
class RequestTiming:
    """One request's life in a run. `arrival_s` is when the request was due (the trace's
    arrival time): latencies count from there, as a client would see them, even when the
    driver loop submitted it later (`submitted_s`)."""

    request_id: str
    arrival_s: float
    expected_tokens: int
    prompt_tokens: int
    submitted_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    output_tokens: int = 0

    def record_tokens(self, now_s: float, count: int) -> None:
        if count > 0 and self.first_token_s is None:
            self.first_token_s = now_s
        self.output_tokens += count

    @property
    def finished(self) -> bool:
        return self.finish_s is not None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (finish - first token) / (n - 1); None for
        requests of fewer than two tokens or not finished."""
        if self.first_token_s is None or self.finish_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def latency_s(self) -> float | None:
        """End-to-end latency, from arrival to the last token."""
        return None if self.finish_s is None else self.finish_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One engine run over a trace."""

    name: str
    arrival: str  # "burst" (all at t=0) or "poisson"
    poisson_rate: float | None
    requests: int
    completed: int
    rejected: int
    truncated: bool  # stopped by its time budget before every request finished
    wall_s: float
    steps: int
    output_tokens: int  # every token produced, finished requests or not
    expected_output_tokens: int  # sum of the replayed lengths of the completed requests
    length_mismatches: int  # completed requests whose token count differs from their length
    prompt_tokens: int
    output_tok_s: float
    requests_per_s: float
    ttft: Distribution | None
    tpot: Distribution | None
    latency: Distribution | None
    preemptions: int
    kv_block_bytes: int
    kv_blocks_total: int
    peak_kv_blocks: int
    peak_kv_bytes: int
    max_memory_allocated_bytes: int | None
    mean_running: float  # mean number of running sequences per step (None-free: 0 if unknown)
    # Requests waiting for admission, sampled after every step (None when not sampled).
    queue_depth_mean: float | None = None
    queue_depth_max: int | None = None


def summarize_run(
    name: str,
    timings: Sequence[RequestTiming],
    *,
    arrival: str,
    poisson_rate: float | None,
    wall_s: float,
    steps: int,
    rejected: int,
    truncated: bool,
    preemptions: int,
    kv_block_bytes: int,
    kv_blocks_total: int,
    peak_kv_blocks: int,
    max_memory_allocated_bytes: int | None,
    mean_running: float,
    queue_depths: Sequence[int] = (),
) -> RunSummary:
    done = [t for t in timings if t.finished]
    produced = sum(t.output_tokens for t in timings)
    wall = max(wall_s, 1e-9)
    return RunSummary(
        name=name,
        arrival=arrival,
        poisson_rate=poisson_rate,
        requests=len(timings),
        completed=len(done),
        rejected=rejected,
        truncated=truncated,
        wall_s=wall_s,
        steps=steps,
        output_tokens=produced,
        expected_output_tokens=sum(t.expected_tokens for t in done),
        length_mismatches=sum(t.output_tokens != t.expected_tokens for t in done),
        prompt_tokens=sum(t.prompt_tokens for t in timings),
        output_tok_s=produced / wall,
        requests_per_s=len(done) / wall,
        ttft=distribution_ms(v for t in timings if (v := t.ttft_s) is not None),
        tpot=distribution_ms(v for t in done if (v := t.tpot_s) is not None),
        latency=distribution_ms(v for t in done if (v := t.latency_s) is not None),
        preemptions=preemptions,
        kv_block_bytes=kv_block_bytes,
        kv_blocks_total=kv_blocks_total,
        peak_kv_blocks=peak_kv_blocks,
        peak_kv_bytes=peak_kv_blocks * kv_block_bytes,
        max_memory_allocated_bytes=max_memory_allocated_bytes,
        mean_running=mean_running,
        queue_depth_mean=statistics.fmean(queue_depths) if queue_depths else None,
        queue_depth_max=max(queue_depths) if queue_depths else None,
    )


# --- static batching (transformers `generate`) ---------------------------------------------


def static_batches(count: int, batch_size: int) -> list[range]:
    """Index ranges of consecutive batches in arrival order (the last one may be smaller)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return [range(i, min(i + batch_size, count)) for i in range(0, count, batch_size)]


def useful_tokens(expected: Sequence[int], generated_steps: int) -> int:
    """Tokens of a padded static batch that requests asked for: the batch ran
    `generated_steps` decode steps for every row, each request needed only its own length."""
    return sum(min(n, generated_steps) for n in expected)


# --- HBM roofline of a decode step -------------------------------------------------------


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of one token across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def roofline_ms(bytes_read: float, bandwidth_bytes_per_s: float) -> float:
    """The shortest time in which a step that must read `bytes_read` bytes from HBM can run."""
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth_bytes_per_s}")
    return bytes_read / bandwidth_bytes_per_s * 1000.0


def _length_stats(values: Sequence[int]) -> dict[str, float]:
    floats = [float(v) for v in values]
    return {
        "mean": sum(floats) / len(floats),
        "p50": percentile(floats, 50),
        "p90": percentile(floats, 90),
        "p99": percentile(floats, 99),
        "max": max(floats),
    }


def describe_workload(requests: Sequence[WorkloadRequest], spec: WorkloadSpec) -> dict[str, Any]:
    """What the results file says about the trace."""
    if not requests:
        return {"requests": 0}
    return {
        "requests": len(requests),
        "by_corpus": dict(Counter(r.corpus for r in requests)),
        "seed": spec.seed,
        "tokenizer": "GPT-2 byte-level BPE (token ids of the real prompt text)",
        "max_prompt_tokens": spec.max_prompt_tokens,
        "max_output_tokens": spec.max_output_tokens,
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "output_tokens": sum(r.output_tokens for r in requests),
        "prompts_truncated": sum(r.prompt_truncated for r in requests),
        "outputs_capped": sum(r.reference_output_tokens > r.output_tokens for r in requests),
        "prompt_length": _length_stats([len(r.prompt_token_ids) for r in requests]),
        "output_length": _length_stats([r.output_tokens for r in requests]),
        "replay": "greedy, ignore_eos, max_tokens = the reference response length (capped)",
    }
