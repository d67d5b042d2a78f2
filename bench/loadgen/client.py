"""Open-loop load through the gateway's public HTTP API: every request is sent at its arrival
offset whether or not earlier ones have answered, streamed (`/v1/completions`, `stream: true`
with usage), so the client sees its first token and every answer's end.

Times are the client's own (perf_counter): TTFT is from sending to the first content event,
end-to-end from sending to `[DONE]`; the gateway-to-site network (the injector) is inside both.
A request still open `drain_s` after the last arrival is cut off. The SLO is on TTFT and TPOT,
so a request cut off while streaming is judged by what it showed: its TTFT, and its TPOT from
the first token to the cut over the content events that came (a lower bound on its tokens when
the gateway sends several in one event, so an upper bound on its TPOT). One cut off before its
first token misses both (it waited at least `drain_s`).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from bench.loadgen.workload import ROUTED_MODEL, Request

SITE_HEADER = "x-fedllm-site"


CUT_OFF = "cut off: still open at the end of the drain"


@dataclass(frozen=True, slots=True)
class Outcome:
    id: str
    source: str
    prompt_tokens: int
    answer_tokens: int  # asked for (max_tokens, ignore_eos)
    sent_s: float  # offset from the run's start
    status: int  # HTTP status; 0: no answer (connection error or cut off)
    site: str | None
    ttft_s: float | None
    e2e_s: float | None
    completion_tokens: int
    error: str | None = None
    content_events: int = 0  # events that carried answer text (one or more tokens each)
    open_s: float | None = None  # from sending to the answer's end or the cut

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.e2e_s is not None

    @property
    def cut_off_streaming(self) -> bool:
        """Cut off at the drain's end after its first token: judged on what it streamed."""
        return self.error == CUT_OFF and self.status == 200 and self.ttft_s is not None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; for a request cut off while streaming,
        over the events it got until the cut (an upper bound)."""
        if self.cut_off_streaming and self.ttft_s is not None and self.open_s is not None:
            return (self.open_s - self.ttft_s) / max(self.content_events - 1, 1)
        if not self.ok or self.ttft_s is None or self.e2e_s is None:
            return None
        if self.completion_tokens <= 1:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


def percentile(values: Sequence[float], share: float) -> float:
    """Nearest-rank percentile; inf for an empty list (nothing answered: the SLO is missed)."""
    if not values:
        return math.inf
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


@dataclass(frozen=True, slots=True)
class RunOutcomes:
    outcomes: tuple[Outcome, ...]
    wall_s: float  # first send to last answer (or the cut-off)


def body(request: Request) -> dict[str, object]:
    prompt: object = request.prompt_text
    if prompt is None:
        prompt = list(request.prompt_token_ids)
    return {
        "model": request.model or ROUTED_MODEL,
        "prompt": prompt,
        "max_tokens": request.answer_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"user": request.session} if request.session else {}),
    }


async def _one(client: httpx.AsyncClient, request: Request, start: float) -> Outcome:
    await asyncio.sleep(max(0.0, start + request.at_s - time.perf_counter()))
    sent = time.perf_counter()
    first: float | None = None
    tokens = events = 0
    site: str | None = None
    status = 0
    error: str | None = None
    try:
        async with client.stream("POST", "/v1/completions", json=body(request)) as response:
            status, site = response.status_code, response.headers.get(SITE_HEADER)
            if status != 200:
                error = (await response.aread()).decode(errors="replace")[:300]
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = str(event["error"])[:300]
                    elif event.get("choices"):
                        events += 1
                        if first is None:
                            first = time.perf_counter()
                    if event.get("usage"):
                        tokens = int(event["usage"]["completion_tokens"])
    except (httpx.HTTPError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
    except asyncio.CancelledError:
        error = CUT_OFF
    end = time.perf_counter()
    done = error is None and status == 200
    return Outcome(
        request.id,
        request.source,
        len(request.prompt_token_ids),
        request.answer_tokens,
        sent - start,
        status,
        site,
        (first - sent) if first is not None else None,
        (end - sent) if done else None,
        tokens,
        error,
        events,
        end - sent,
    )


async def run_open_loop(
    base_url: str, requests: Sequence[Request], drain_s: float, timeout_s: float = 3600.0
) -> RunOutcomes:
    """Sends every request at its offset; cuts off what is still open `drain_s` after the last
    arrival."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        tasks = [asyncio.create_task(_one(client, r, start)) for r in requests]
        last = max((r.at_s for r in requests), default=0.0)
        deadline = start + last + drain_s
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for task in pending:
            task.cancel()
        outcomes = [await task for task in tasks]
        wall = time.perf_counter() - start
    return RunOutcomes(tuple(outcomes), wall)
