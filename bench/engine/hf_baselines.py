"""The transformers baselines of the GPU benchmark, run on the same model and the same requests.

* `generate` with static batches: consecutive requests in arrival order, `max_batch_size` at a
  time, left-padded to the batch's longest prompt, every row generating the batch's longest
  reference length (min_new_tokens = max_new_tokens, so EOS cannot end a row early). Only each
  request's own reference length counts as useful output: the rest is what static batching
  wastes.
* continuous batching (what `generate_batch` runs): by default through the manager that
  `generate_batch` wraps (`init_continuous_batching` + `add_request(max_new_tokens=...)`), so
  every request stops at its own reference length, as in this engine. `api="generate_batch"`
  calls `generate_batch` itself, which takes one max_new_tokens for all requests (the subset's
  longest; useful tokens are counted as for static batching) and cannot be stopped early.

Both take a time budget: `generate` stops between batches, and mid-batch through transformers'
`max_time`; the manager stops taking results when the budget is spent. Either reports what it
measured up to then, flagged `truncated`. The continuous-batching API moved between transformers
releases, so it is called through signature checks, and any failure is returned as an error
result rather than raised.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from bench.engine.metrics import static_batches, useful_tokens
from bench.engine.workload import WorkloadRequest

Log = Callable[[str], None]
BatchApi = Literal["manager", "generate_batch"]


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


def _error_text(exc: BaseException) -> str:
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    text = "".join(lines)
    return text if len(text) <= 4000 else text[:1000] + "\n...\n" + text[-3000:]


def _transformers_version() -> str:
    import transformers

    return str(getattr(transformers, "__version__", "unknown"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _eos_id(model: Any, fallback: int) -> int:
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
            "transformers": _transformers_version(),
            "max_batch_size": max_batch_size,
            "time_budget_s": time_budget_s,
        },
    )
    device = torch.device(model.device)
    started = time.perf_counter()
    try:
        from transformers import GenerationConfig

        eos = _eos_id(model, pad_token_id)
        result.details["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
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
        result.warmup_s = time.perf_counter() - warm_started
        started = time.perf_counter()
        for batch in static_batches(len(requests), max_batch_size):
            remaining = time_budget_s - (time.perf_counter() - started)
            if remaining <= 0:
                result.truncated = True
                break
            rows = [requests[i] for i in batch]
            longest = max(len(r.prompt_token_ids) for r in rows)
            input_ids = torch.full((len(rows), longest), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(rows), longest), dtype=torch.long)
            for j, row in enumerate(rows):
                n = len(row.prompt_token_ids)
                input_ids[j, longest - n :] = torch.tensor(row.prompt_token_ids, dtype=torch.long)
                mask[j, longest - n :] = 1
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
            with torch.inference_mode():
                out = model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=mask.to(device),
                    generation_config=config,
                )
            _sync(device)
            steps = int(out.shape[1]) - longest
            del out
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
        result.error = _error_text(exc)
        log(f"  hf generate failed: {type(exc).__name__}: {exc}")
    wall = time.perf_counter() - started
    _free_memory(device)
    return result.finish(wall)


# --- continuous batching -----------------------------------------------------------------


def _accepted(func: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return set()


def _continuous_batching_config(limits: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A ContinuousBatchingConfig with the limits this transformers version knows, or None if
    it has no such class (older releases read the limits from the GenerationConfig)."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        except ImportError:
            return None, {}
    if dataclasses.is_dataclass(ContinuousBatchingConfig):
        known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    else:
        known = _accepted(ContinuousBatchingConfig)
    chosen = {k: v for k, v in limits.items() if k in known and v is not None}
    return ContinuousBatchingConfig(**chosen), chosen


def _workload_hints(requests: Sequence[WorkloadRequest], max_new: int) -> Any:
    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return None
    wanted = {
        "max_prompt_length": max(len(r.prompt_token_ids) for r in requests),
        "max_generated_length": max_new,
        "num_requests": len(requests),
    }
    known = _accepted(WorkloadHints)
    return WorkloadHints(**{k: v for k, v in wanted.items() if k in known})


def _is_finished(output: Any) -> bool:
    check = getattr(output, "is_finished", None)
    if callable(check):
        return bool(check())
    status = getattr(output, "status", None)
    return getattr(status, "name", str(status)) in ("FINISHED", "FAILED")


def _generated(output: Any) -> list[int]:
    return list(getattr(output, "generated_tokens", None) or [])


def run_hf_generate_batch(
    model: Any,
    requests: Sequence[WorkloadRequest],
    *,
    max_batch_size: int,
    max_batch_tokens: int,
    time_budget_s: float,
    log: Log,
    num_blocks: int | None = None,
    api: BatchApi = "manager",
) -> BaselineResult:
    """transformers' continuous batching on the subset; never raises (errors are recorded)."""
    result = BaselineResult(
        name="hf_generate_batch",
        api=(
            "model.init_continuous_batching + manager.add_request(max_new_tokens=own length) "
            "(the manager generate_batch wraps)"
            if api == "manager"
            else "model.generate_batch(max_new_tokens=subset max), useful tokens counted"
        ),
        requests=len(requests),
        details={
            "transformers": _transformers_version(),
            "time_budget_s": time_budget_s,
            "attn_implementation_before": getattr(model.config, "_attn_implementation", None),
        },
    )
    device = torch.device(model.device)
    started = time.perf_counter()
    wall: float | None = None
    try:
        if not requests:
            raise ValueError("no requests")
        from transformers import GenerationConfig

        max_new = max(r.output_tokens for r in requests)
        limits = {
            "max_requests_per_batch": max_batch_size,
            "max_batch_tokens": max_batch_tokens,
            "num_blocks": num_blocks,
        }
        cb_config, applied = _continuous_batching_config(limits)
        result.details["requested_limits"] = {k: v for k, v in limits.items() if v is not None}
        result.details["applied_limits"] = applied
        legacy = {} if cb_config is not None else {k: v for k, v in limits.items() if v}
        generation_config = GenerationConfig(
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,  # continuous batching reads None as "no EOS" (-1)
            pad_token_id=_eos_id(model, 0),
            **legacy,
        )
        if legacy:
            result.details["applied_limits"] = {"generation_config": legacy}
        if api == "generate_batch":
            wall = _generate_batch_call(model, requests, generation_config, cb_config, result)
        else:
            wall = _manager_run(
                model, requests, generation_config, cb_config, max_new, time_budget_s, result, log
            )
    except Exception as exc:
        result.status = "error"
        result.error = _error_text(exc)
        log(f"  hf generate_batch failed: {type(exc).__name__}: {exc}")
    result.details["attn_implementation_after"] = getattr(
        model.config, "_attn_implementation", None
    )
    _free_memory(device)
    return result.finish(wall if wall is not None else time.perf_counter() - started)


def _manager_run(
    model: Any,
    requests: Sequence[WorkloadRequest],
    generation_config: Any,
    cb_config: Any,
    max_new: int,
    time_budget_s: float,
    result: BaselineResult,
    log: Log,
) -> float:
    """Runs the requests through a continuous batching manager; returns the measured wall
    time (warm-up excluded, recorded in result.warmup_s)."""
    init = model.init_continuous_batching
    accepted = _accepted(init)
    kwargs: dict[str, Any] = {"generation_config": generation_config}
    if cb_config is not None and "continuous_batching_config" in accepted:
        kwargs["continuous_batching_config"] = cb_config
    if "workload_hints" in accepted:
        hints = _workload_hints(requests, max_new)
        if hints is not None:
            kwargs["workload_hints"] = hints
    warm_started = time.perf_counter()
    manager = init(**kwargs)
    pending = {r.request_id: r for r in requests}
    started = time.perf_counter()
    try:
        if callable(getattr(manager, "warmup", None)) and not getattr(manager, "warmed_up", False):
            manager.warmup()
        result.details["resolved_config"] = repr(
            getattr(manager, "continuous_batching_config", None)
        )[:3000]
        result.details["attn_implementation_during"] = getattr(
            model.config, "_attn_implementation", None
        )
        manager.start()
        result.warmup_s = time.perf_counter() - warm_started
        log(f"  hf continuous batching ready after {result.warmup_s:.1f}s (init + warm-up)")
        add_accepted = _accepted(manager.add_request)
        extra: dict[str, Any] = {"eos_token_id": -1} if "eos_token_id" in add_accepted else {}
        started = time.perf_counter()
        for request in requests:
            manager.add_request(
                input_ids=list(request.prompt_token_ids),
                request_id=request.request_id,
                max_new_tokens=request.output_tokens,
                **extra,
            )
        last_log = started
        while pending:
            now = time.perf_counter()
            if now - started > time_budget_s:
                result.truncated = True
                break
            if now - last_log > 15:
                done = len(requests) - len(pending)
                log(f"  hf continuous batching: {done}/{len(requests)} requests done")
                last_log = now
            left = time_budget_s - (now - started)
            output = manager.get_result(timeout=min(1.0, max(0.05, left)))
            if output is None:
                if not manager.is_running():
                    status = getattr(manager, "background_thread_status", None)
                    fatal = getattr(status, "fatal_error", None)
                    raise RuntimeError(
                        "the continuous batching thread stopped with "
                        f"{len(pending)} request(s) unfinished"
                        + (f": {fatal!r}" if fatal is not None else "")
                    )
                continue
            finished = pending.get(str(output.request_id))
            if finished is None or not _is_finished(output):
                continue
            del pending[finished.request_id]
            tokens = _generated(output)
            if getattr(output, "error", None):
                result.failed_requests += 1
                result.details.setdefault("first_request_error", str(output.error)[:2000])
            else:
                result.completed_requests += 1
            result.useful_tokens += min(len(tokens), finished.output_tokens)
            result.generated_tokens += len(tokens)
            if len(tokens) != finished.output_tokens:
                result.details["length_mismatches"] = (
                    int(result.details.get("length_mismatches", 0)) + 1
                )
        wall = time.perf_counter() - started
    finally:
        _stop_manager(manager, hard=bool(pending), pending=list(pending), result=result)
    if result.failed_requests and not result.completed_requests:
        result.status = "error"
        result.error = str(result.details.get("first_request_error"))
    return wall


def _stop_manager(manager: Any, *, hard: bool, pending: list[str], result: BaselineResult) -> None:
    try:
        stop_kwargs: dict[str, Any] = {"block": True, "timeout": 30.0}
        accepted = _accepted(manager.stop)
        if hard and "hard_stop" in accepted:
            stop_kwargs["hard_stop"] = True
        elif hard and callable(getattr(manager, "cancel_request", None)):
            for request_id in pending:
                manager.cancel_request(request_id)
        manager.stop(**{k: v for k, v in stop_kwargs.items() if k in accepted or not accepted})
        if callable(getattr(manager, "destroy", None)):
            manager.destroy()
    except Exception as exc:  # the measurement is done; a failed clean-up only gets recorded
        result.details["stop_error"] = _error_text(exc)


def _generate_batch_call(
    model: Any,
    requests: Sequence[WorkloadRequest],
    generation_config: Any,
    cb_config: Any,
    result: BaselineResult,
) -> float:
    """One `generate_batch` call (warm-up included in its time: it cannot be separated)."""
    accepted = _accepted(model.generate_batch)
    kwargs: dict[str, Any] = {}
    if cb_config is not None and "continuous_batching_config" in accepted:
        kwargs["continuous_batching_config"] = cb_config
    if "progress_bar" in accepted:
        kwargs["progress_bar"] = False
    inputs = [list(r.prompt_token_ids) for r in requests]
    started = time.perf_counter()
    outputs = model.generate_batch(inputs=inputs, generation_config=generation_config, **kwargs)
    wall = time.perf_counter() - started
    result.details["warmup_included"] = True
    values = list(outputs.values())
    by_index = [outputs.get(f"req_{i}") for i in range(len(requests))]
    ordered = by_index if all(o is not None for o in by_index) else values
    for request, output in zip(requests, ordered, strict=False):
        tokens = _generated(output)
        if getattr(output, "error", None):
            result.failed_requests += 1
        else:
            result.completed_requests += 1
        result.useful_tokens += min(len(tokens), request.output_tokens)
        result.generated_tokens += len(tokens)
    result.batches = 1
    return wall
