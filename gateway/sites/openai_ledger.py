"""The load of an OpenAI-compatible engine as the gateway sees it, turned into load reports.

Such an engine pushes nothing, so a report is built from two sources: this client's own ledger
(what it sent, what is streaming, the predicted tokens still to come), which is exact for the
gateway's own traffic and up to date, and the engine's last scraped metrics (engine_metrics.py),
which see every client's traffic but only as counts and a KV fraction. Each figure is the larger
of the two, as the registry merges a gRPC site's report with the ledger: neither source alone may
hide load the other sees.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from gateway.sites.engine_metrics import EngineMetrics
from gateway.sites.interface import LoadView

_RATE_WINDOW_S = 5.0


@dataclass(slots=True)
class _Sent:
    prompt_tokens: int
    planned_answer: int
    produced: int = 0
    streaming: bool = False


@dataclass(slots=True)
class _Rate:
    """Tokens per second over a window, from a cumulative counter or from observed tokens."""

    points: deque[tuple[float, float]] = field(default_factory=deque)

    def add(self, now: float, total: float) -> None:
        if self.points and total < self.points[-1][1]:
            self.points.clear()  # the counter was reset (the engine restarted)
        self.points.append((now, total))
        while len(self.points) > 2 and now - self.points[1][0] >= _RATE_WINDOW_S:
            self.points.popleft()

    def rate(self) -> float:
        if len(self.points) < 2:
            return 0.0
        (t0, v0), (t1, v1) = self.points[0], self.points[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0


@dataclass(slots=True)
class OpenAILedger:
    """Contract: `sent` then any number of `produced` then `done` per request id; `report`
    never counts a finished request, and never reports less than the engine's own gauges."""

    _requests: dict[str, _Sent] = field(default_factory=dict)
    _produced_total: int = 0
    _own_rate: _Rate = field(default_factory=_Rate)
    _engine_rate: _Rate = field(default_factory=_Rate)
    metrics: EngineMetrics | None = None
    _sequence: int = 0

    def sent(self, request_id: str, prompt_tokens: int, planned_answer: int) -> None:
        self._requests[request_id] = _Sent(prompt_tokens, planned_answer)

    def produced(self, request_id: str, tokens: int) -> None:
        entry = self._requests.get(request_id)
        if entry is None:
            return
        entry.streaming = True
        entry.produced += tokens
        self._produced_total += tokens
        self._own_rate.add(time.monotonic(), self._produced_total)

    def done(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def scraped(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        if metrics.generation_tokens_total is not None:
            self._engine_rate.add(time.monotonic(), metrics.generation_tokens_total)

    def decode_tokens_per_s(self) -> float:
        engine = self.metrics
        if engine is not None and engine.generation_tokens_per_s is not None:
            return engine.generation_tokens_per_s
        if engine is not None and engine.generation_tokens_total is not None:
            return self._engine_rate.rate()
        return self._own_rate.rate()

    def report(self, kv_capacity_tokens: int | None) -> LoadView:
        waiting = [r for r in self._requests.values() if not r.streaming]
        streaming = [r for r in self._requests.values() if r.streaming]
        engine = self.metrics
        capacity = kv_capacity_tokens or 0
        kv_used = 0
        if engine is not None and engine.kv_usage is not None and capacity:
            kv_used = round(min(max(engine.kv_usage, 0.0), 1.0) * capacity)
        own_running = sum(r.prompt_tokens + r.produced for r in streaming)
        self._sequence += 1
        return LoadView(
            queued_requests=max(len(waiting), engine.waiting_requests if engine else 0),
            running_requests=max(len(streaming), engine.running_requests if engine else 0),
            queued_prompt_tokens=sum(r.prompt_tokens for r in waiting),
            running_tokens=max(own_running, kv_used),
            predicted_remaining_tokens=sum(
                max(r.planned_answer - r.produced, 0) for r in self._requests.values()
            ),
            # The KV pool in tokens, as blocks of one token: the engine's blocks are its own.
            kv_blocks_used=max(kv_used, own_running) if capacity else 0,
            kv_blocks_total=capacity,
            decode_tokens_per_s=self.decode_tokens_per_s(),
            iterations=0,
            sequence=self._sequence,
        )
