"""The transformers baselines of the GPU benchmark, run on the same model and the same requests.

This module owns what both baselines share, their result record (BaselineResult: useful tokens
against tokens computed, a status of ok, truncated or error) and its helpers, and the first of
them: `generate` with static batches. Consecutive requests in arrival order go `max_batch_size`
at a time, left-padded to the batch's longest prompt, every row generating the batch's longest
reference length (min_new_tokens = max_new_tokens, so EOS cannot end a row early). Only each
request's own reference length counts as useful output: the rest is what static batching
wastes. It takes a time budget: `generate` stops between batches, and mid-batch through
transformers' `max_time`, and reports what it measured up to then, flagged `truncated`.
Continuous batching, the second baseline, is in bench.engine.hf_continuous.
"""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.engine.metrics import static_batches, useful_tokens
from fedsim.engine_trace import WorkloadRequest

Log = Callable[[str], None]


@dataclass(slots=True)
class BaselineResult:
    name: str
    api: str
    status: str = "ok"  # ok | truncated | error | skipped
    error: str | None = None
    requests: int = 0  # the subset given
    completed_requests: int = 0
    failed_requests: int = 0
    useful_tokens: int = 0  # tokens the requests asked for (their reference lengths)
    generated_tokens: int = 0  # tokens computed, padding rows included
    wall_s: float = 0.0
    useful_tok_s: float | None = None
    generated_tok_s: float | None = None
    truncated: bool = False
    warmup_s: float = 0.0
    batches: int = 0
    details: dict[str, Any] = field(default_factory=dict)

    def finish(self, wall_s: float) -> BaselineResult:
        self.wall_s = wall_s
        if wall_s > 0 and (self.useful_tokens or self.status != "error"):
            self.useful_tok_s = self.useful_tokens / wall_s
            self.generated_tok_s = self.generated_tokens / wall_s
        if self.truncated and self.status == "ok":
            self.status = "truncated"
        return self


def error_text(exc: BaseException) -> str:
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    text = "".join(lines)
    return text if len(text) <= 4000 else text[:1000] + "\n...\n" + text[-3000:]


def transformers_version() -> str:
    import transformers

    return str(getattr(transformers, "__version__", "unknown"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def eos_id(model: Any, fallback: int) -> int:
    value = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if value is None:
        value = getattr(model.config, "eos_token_id", None)
    if isinstance(value, list | tuple):
        value = value[0] if value else None
    return int(value) if value is not None else fallback


# --- static batches through `generate` ---------------------------------------------------


def run_hf_generate(
    model: Any,
    requests: Sequence[WorkloadRequest],
    *,
    max_batch_size: int,
    pad_token_id: int,
    time_budget_s: float,
    log: Log,
) -> BaselineResult:
    """Static batching through `model.generate`; see the module docstring."""
    result = BaselineResult(
        name="hf_generate",
        api="model.generate, static batches, left padding",
        requests=len(requests),
        details={
            "transformers": transformers_version(),
            "max_batch_size": max_batch_size,
            "time_budget_s": time_budget_s,
        },
    )
    device = torch.device(model.device)
    started = time.perf_counter()
    try:
        from transformers import GenerationConfig

        eos = eos_id(model, pad_token_id)
        result.details["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        result.warmup_s = _warm_up(model, requests, pad_token_id, eos, device)
        started = time.perf_counter()
        for batch in static_batches(len(requests), max_batch_size):
            remaining = time_budget_s - (time.perf_counter() - started)
            if remaining <= 0:
                result.truncated = True
                break
            rows = [requests[i] for i in batch]
            longest, input_ids, mask = _left_padded(rows, pad_token_id)
            max_new = max(r.output_tokens for r in rows)
            config = GenerationConfig(
                max_new_tokens=max_new,
                min_new_tokens=max_new,  # EOS is masked until then: every row runs max_new steps
                do_sample=False,
                pad_token_id=pad_token_id,
                eos_token_id=eos,
                max_time=remaining,
            )
            batch_started = time.perf_counter()
            steps = _generate_steps(model, input_ids, mask, config, device)
            result.batches += 1
            result.useful_tokens += useful_tokens([r.output_tokens for r in rows], steps)
            result.generated_tokens += steps * len(rows)
            log(
                f"  hf generate batch {result.batches}: {len(rows)} requests, prompt pad "
                f"{longest}, {steps}/{max_new} steps in {time.perf_counter() - batch_started:.1f}s"
            )
            if steps < max_new:
                result.truncated = True  # max_time cut the batch short
                result.completed_requests += sum(r.output_tokens <= steps for r in rows)
                break
            result.completed_requests += len(rows)
    except Exception as exc:
        result.status = "error"
        result.error = error_text(exc)
        log(f"  hf generate failed: {type(exc).__name__}: {exc}")
    wall = time.perf_counter() - started
    free_memory(device)
    return result.finish(wall)


def _warm_up(
    model: Any,
    requests: Sequence[WorkloadRequest],
    pad_token_id: int,
    eos: int,
    device: torch.device,
) -> float:
    """One short `generate` call, so first-call costs stay out of the timing; returns its time."""
    from transformers import GenerationConfig

    warm = requests[0].prompt_token_ids[:8] if requests else (pad_token_id,)
    warm_started = time.perf_counter()
    model.generate(
        input_ids=torch.tensor([list(warm)], device=device),
        attention_mask=torch.ones((1, len(warm)), dtype=torch.long, device=device),
        generation_config=GenerationConfig(
            max_new_tokens=2,
            min_new_tokens=2,
            do_sample=False,
            pad_token_id=pad_token_id,
            eos_token_id=eos,
        ),
    )
    _sync(device)
    return time.perf_counter() - warm_started


def _left_padded(
    rows: Sequence[WorkloadRequest], pad_token_id: int
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(longest prompt, input ids, attention mask) of a batch left-padded to its longest prompt."""
    longest = max(len(r.prompt_token_ids) for r in rows)
    input_ids = torch.full((len(rows), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for j, row in enumerate(rows):
        n = len(row.prompt_token_ids)
        input_ids[j, longest - n :] = torch.tensor(row.prompt_token_ids, dtype=torch.long)
        mask[j, longest - n :] = 1
    return longest, input_ids, mask


def _generate_steps(
    model: Any, input_ids: torch.Tensor, mask: torch.Tensor, config: Any, device: torch.device
) -> int:
    """One static batch through `generate`; returns how many steps it ran."""
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=mask.to(device),
            generation_config=config,
        )
    _sync(device)
    steps = int(out.shape[1]) - input_ids.shape[1]
    del out
    return steps
