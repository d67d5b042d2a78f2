"""transformers continuous batching under the same open-loop arrivals as this engine.

The requests of one rate of the sweep (same prompts, answers and Poisson arrival times) go to
transformers' continuous batching manager (what `generate_batch` wraps), each added when its
arrival time comes, with streaming and per-token timestamps on: the first streamed output of a
request gives its TTFT, the last its token count, so tokens of requests still running when the
time budget ends are counted too (an open loop at a rate the baseline cannot sustain never
drains). The manager runs in its own thread; this one feeds arrivals and reads outputs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from bench.engine.hf_baselines import (
    BaselineResult,
    eos_id,
    error_text,
    free_memory,
    transformers_version,
)
from bench.engine.hf_continuous import (
    _accepted,
    _continuous_batching_config,
    _init_kwargs,
    _stop_manager,
)
from bench.engine.metrics import distribution_ms
from fedsim.engine_trace import WorkloadRequest


def _generation_config(model: Any, max_new: int, limits: dict[str, Any]) -> tuple[Any, Any]:
    from transformers import GenerationConfig

    cb_config, _ = _continuous_batching_config(limits)
    legacy = {} if cb_config is not None else {k: v for k, v in limits.items() if v}
    config = GenerationConfig(
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,  # continuous batching reads None as "no EOS"
        pad_token_id=eos_id(model, 0),
        **legacy,
    )
    return config, cb_config


class _Tracker:
    """Per request: arrival, first-token and last-token times, tokens so far."""

    def __init__(self) -> None:
        self.arrival: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self.finished: set[str] = set()

    def record(self, output: Any) -> None:
        request_id = str(output.request_id)
        if request_id not in self.arrival:
            return
        stamps = list(getattr(output, "timestamps", None) or [])
        count = len(getattr(output, "generated_tokens", None) or [])
        if stamps:
            self.first.setdefault(request_id, stamps[0])
            self.last[request_id] = stamps[-1]
        self.tokens[request_id] = max(count, self.tokens.get(request_id, 0))
        check = getattr(output, "is_finished", None)
        if callable(check) and check():
            self.finished.add(request_id)

    def summary(self, wall_s: float) -> dict[str, Any]:
        ttft = [self.first[r] - self.arrival[r] for r in self.first]
        tpot = [
            (self.last[r] - self.first[r]) / (self.tokens[r] - 1)
            for r in self.finished
            if r in self.first and self.tokens.get(r, 0) > 1
        ]
        produced = sum(self.tokens.values())
        ttft_ms, tpot_ms = distribution_ms(ttft), distribution_ms(tpot)
        return {
            "submitted": len(self.arrival),
            "completed": len(self.finished),
            "started": len(self.first),
            "output_tokens": produced,
            "wall_s": wall_s,
            "output_tok_s": produced / wall_s if wall_s > 0 else None,
            "ttft_p50_ms": ttft_ms.p50_ms if ttft_ms else None,
            "ttft_p99_ms": ttft_ms.p99_ms if ttft_ms else None,
            "tpot_p50_ms": tpot_ms.p50_ms if tpot_ms else None,
            "tpot_p99_ms": tpot_ms.p99_ms if tpot_ms else None,
            "ttft_note": "over the requests that produced a token before the budget ended",
        }


def run_hf_open_loop(
    model: Any,
    requests: Sequence[WorkloadRequest],
    arrivals: Sequence[float],
    *,
    rate: float,
    max_batch_size: int,
    max_batch_tokens: int,
    budget_s: float,
    log: Any,
) -> dict[str, Any]:
    """Feeds `requests` at `arrivals` to a continuous batching manager; never raises."""
    result: dict[str, Any] = {
        "api": "model.init_continuous_batching + manager.add_request(streaming, timestamps)",
        "transformers": transformers_version(),
        "rate_rps": rate,
        "requests": len(requests),
        "budget_s": budget_s,
    }
    tracker = _Tracker()
    manager = None
    started = time.perf_counter()
    try:
        max_new = max(r.output_tokens for r in requests)
        limits = {"max_requests_per_batch": max_batch_size, "max_batch_tokens": max_batch_tokens}
        generation_config, cb_config = _generation_config(model, max_new, limits)
        init = model.init_continuous_batching
        manager = init(**_init_kwargs(init, requests, generation_config, cb_config, max_new))
        if callable(getattr(manager, "warmup", None)) and not getattr(manager, "warmed_up", False):
            manager.warmup()
        manager.start()
        result["init_s"] = time.perf_counter() - started
        log(f"  hf open loop @ {rate:g} req/s: manager ready after {result['init_s']:.1f}s")
        extra = {"eos_token_id": -1} if "eos_token_id" in _accepted(manager.add_request) else {}
        started = _feed(manager, requests, arrivals, tracker, budget_s, extra)
    except Exception as exc:
        result["error"] = error_text(exc)
        log(f"  hf open loop failed: {type(exc).__name__}: {exc}")
    wall = time.perf_counter() - started
    if manager is not None:
        pending = [r.request_id for r in requests if r.request_id not in tracker.finished]
        stopped = BaselineResult(name="hf_open_loop", api=result["api"])
        _stop_manager(manager, hard=bool(pending), pending=pending, result=stopped)
        result.update(stopped.details)
    result.update(tracker.summary(wall))
    free_memory(model.device)
    return result


def _feed(
    manager: Any,
    requests: Sequence[WorkloadRequest],
    arrivals: Sequence[float],
    tracker: _Tracker,
    budget_s: float,
    extra: dict[str, Any],
) -> float:
    """Adds each request at its arrival time and reads outputs until all finish or the budget
    ends; returns the start of the clock."""
    started = time.perf_counter()
    index = 0
    while True:
        now = time.perf_counter() - started
        while index < len(requests) and arrivals[index] <= now:
            request = requests[index]
            tracker.arrival[request.request_id] = started + arrivals[index]
            manager.add_request(
                input_ids=list(request.prompt_token_ids),
                request_id=request.request_id,
                max_new_tokens=request.output_tokens,
                streaming=True,
                record_timestamps=True,
                **extra,
            )
            index += 1
        if now > budget_s or len(tracker.finished) == len(requests):
            return started
        wait = arrivals[index] - now if index < len(requests) else 0.05
        output = manager.get_result(timeout=max(0.001, min(wait, 0.05)))
        if output is not None:
            tracker.record(output)
        elif not manager.is_running():
            raise RuntimeError("the continuous batching thread stopped")
