"""transformers' continuous batching, the second transformers baseline of the GPU benchmark.

This module owns the continuous-batching baseline (what `generate_batch` runs) on the same model
and requests as this engine. By default it goes through the manager that `generate_batch` wraps
(`init_continuous_batching` + `add_request(max_new_tokens=...)`), so every request stops at its
own reference length, as in this engine; `api="generate_batch"` calls `generate_batch` itself,
which takes one max_new_tokens for all requests (the subset's longest; useful tokens are counted
as for static batching) and cannot be stopped early. The manager stops taking results when the
time budget is spent and reports what it measured up to then, flagged `truncated`. The API moved
between transformers releases, so it is called through signature checks, and any failure is
returned as an error result rather than raised.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from bench.engine.hf_baselines import (
    BaselineResult,
    Log,
    eos_id,
    error_text,
    free_memory,
    transformers_version,
)
from fedsim.engine_trace import WorkloadRequest

BatchApi = Literal["manager", "generate_batch"]


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
            "transformers": transformers_version(),
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
            pad_token_id=eos_id(model, 0),
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
        result.error = error_text(exc)
        log(f"  hf generate_batch failed: {type(exc).__name__}: {exc}")
    result.details["attn_implementation_after"] = getattr(
        model.config, "_attn_implementation", None
    )
    free_memory(device)
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
    kwargs = _init_kwargs(init, requests, generation_config, cb_config, max_new)
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
        _collect_results(manager, requests, pending, started, time_budget_s, result, log)
        wall = time.perf_counter() - started
    finally:
        _stop_manager(manager, hard=bool(pending), pending=list(pending), result=result)
    if result.failed_requests and not result.completed_requests:
        result.status = "error"
        result.error = str(result.details.get("first_request_error"))
    return wall


def _collect_results(
    manager: Any,
    requests: Sequence[WorkloadRequest],
    pending: dict[str, WorkloadRequest],
    started: float,
    time_budget_s: float,
    result: BaselineResult,
    log: Log,
) -> None:
    """Takes the manager's results until every request is done or the budget is spent; each
    finished request leaves `pending`."""
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
        _record_finished(finished, output, result)


def _init_kwargs(
    init: Callable[..., Any],
    requests: Sequence[WorkloadRequest],
    generation_config: Any,
    cb_config: Any,
    max_new: int,
) -> dict[str, Any]:
    """The arguments of init_continuous_batching that this transformers version accepts."""
    accepted = _accepted(init)
    kwargs: dict[str, Any] = {"generation_config": generation_config}
    if cb_config is not None and "continuous_batching_config" in accepted:
        kwargs["continuous_batching_config"] = cb_config
    if "workload_hints" in accepted:
        hints = _workload_hints(requests, max_new)
        if hints is not None:
            kwargs["workload_hints"] = hints
    return kwargs


def _record_finished(request: WorkloadRequest, output: Any, result: BaselineResult) -> None:
    """Counts one finished request's tokens (useful up to its own reference length)."""
    tokens = _generated(output)
    if getattr(output, "error", None):
        result.failed_requests += 1
        result.details.setdefault("first_request_error", str(output.error)[:2000])
    else:
        result.completed_requests += 1
    result.useful_tokens += min(len(tokens), request.output_tokens)
    result.generated_tokens += len(tokens)
    if len(tokens) != request.output_tokens:
        result.details["length_mismatches"] = int(result.details.get("length_mismatches", 0)) + 1


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
        result.details["stop_error"] = error_text(exc)


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
