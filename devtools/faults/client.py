"""A client of the public HTTP API that records exactly what it saw, and a tally of outcomes.

Every request ends in one of three outcomes:
- completed: a 200 whose answer is whole (a finish reason; for a stream, `[DONE]` and no error
  event), with as many tokens as usage says;
- retryable: a 429 or 503 that carries Retry-After (or a 409 with Retry-After: an
  Idempotency-Key whose first attempt still holds it), or a connection refused or broken before
  any response; an answer cut off by a broken connection only where the gateway was killed;
- lost: anything else, e.g. a 500 or 502, an error event inside a stream, a truncated answer, or
  no answer within the client's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

Outcome = Literal["completed", "retryable", "lost"]


@dataclass(slots=True)
class Result:
    kind: str  # "stream" or "plain"
    outcome: Outcome
    saw: str  # what the client saw, in a few words
    latency_s: float
    accepted: bool = False  # the gateway answered 200 (stream: its headers came)
    status: int | None = None
    request_id: str | None = None
    site: str | None = None
    text: str = ""
    completion_tokens: int | None = None
    tokens_seen: int = 0  # stream: content events received
    retry_after_s: float | None = None

    async def back_off(self) -> None:
        """What a polite client does before its next request: wait as long as Retry-After says
        (at most 2 s), or half a second after a broken connection."""
        if self.outcome == "retryable":
            await asyncio.sleep(min(self.retry_after_s or 0.5, 2.0))


def _retry_after(response: httpx.Response) -> bool:
    """429 or 503 with Retry-After; or 409 with Retry-After, the gateway's answer to a retry
    whose Idempotency-Key is still held by the first attempt (come back later for its result)."""
    return response.status_code in (409, 429, 503) and bool(response.headers.get("retry-after"))


def _error_result(kind: str, response: httpx.Response, body: bytes, started: float) -> Result:
    code = ""
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        code = str(json.loads(body)["error"].get("code") or "")
    retryable = _retry_after(response)
    saw = f"{response.status_code} {code}".strip()
    if retryable:
        saw += " + Retry-After"
    result = Result(
        kind,
        "retryable" if retryable else "lost",
        saw,
        time.monotonic() - started,
        status=response.status_code,
    )
    if retryable:
        with contextlib.suppress(ValueError):
            result.retry_after_s = float(response.headers["retry-after"])
    return result


async def complete(
    client: httpx.AsyncClient,
    prompt: str,
    max_tokens: int,
    *,
    stream: bool,
    headers: Mapping[str, str] | None = None,
    temperature: float = 0.0,
    on_token: Any = None,
    cut_is_retryable: bool = False,
) -> Result:
    """One /v1/completions request (ignore_eos, so the answer is exactly max_tokens long)."""
    kind = "stream" if stream else "plain"
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    started = time.monotonic()
    result: Result | None = None
    try:
        async with client.stream(
            "POST", "/v1/completions", json=body, headers=dict(headers or {})
        ) as response:
            if response.status_code != 200:
                return _error_result(kind, response, await response.aread(), started)
            result = Result(kind, "lost", "200, answer cut short", 0.0, accepted=True, status=200)
            result.site = response.headers.get("x-fedllm-site")
            if stream:
                await _read_stream(response, result, on_token)
            else:
                _read_plain(json.loads(await response.aread()), result)
    except httpx.TimeoutException:
        base = result or Result(kind, "lost", "", 0.0)
        base.outcome, base.saw = "lost", "no answer within the client timeout"
        base.latency_s = time.monotonic() - started
        return base
    except (httpx.TransportError, httpx.StreamError) as exc:
        base = result or Result(kind, "retryable", "", 0.0)
        # Before any response a client knows nothing was answered and retries. An answer cut
        # off half way is retryable only where the gateway itself died (cut_is_retryable);
        # a live gateway that breaks off an answer has lost it.
        base.outcome = "retryable" if not base.accepted or cut_is_retryable else "lost"
        when = "after the response began" if base.accepted else "before any response"
        base.saw = f"connection error {when} ({type(exc).__name__})"
        base.latency_s = time.monotonic() - started
        return base
    result.latency_s = time.monotonic() - started
    if result.outcome == "completed" and result.completion_tokens != max_tokens:
        result.outcome = "lost"
        result.saw = f"200 but {result.completion_tokens} of {max_tokens} tokens"
    return result


def _read_plain(payload: dict[str, Any], result: Result) -> None:
    result.request_id = payload.get("id")
    choice = payload["choices"][0]
    result.text = choice["text"]
    result.completion_tokens = payload["usage"]["completion_tokens"]
    if choice.get("finish_reason") in ("stop", "length"):
        result.outcome, result.saw = "completed", "200, whole answer"


async def _read_stream(response: httpx.Response, result: Result, on_token: Any) -> None:
    finish: str | None = None
    parts: list[str] = []
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            if finish in ("stop", "length") and result.saw != "error event":
                result.outcome, result.saw = "completed", "200 stream, whole answer"
            break
        event = json.loads(data)
        if "error" in event:
            code = event["error"].get("code")
            result.outcome, result.saw = "lost", f"error event in the stream ({code})"
            continue
        result.request_id = event.get("id", result.request_id)
        if event.get("usage"):
            result.completion_tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            if choice.get("text"):
                parts.append(choice["text"])
                result.tokens_seen += 1
                if on_token is not None:
                    on_token(result)
            finish = choice.get("finish_reason") or finish
    result.text = "".join(parts)


@dataclass
class Tally:
    """Outcomes of many requests: the figures every fault scenario reports."""

    results: list[Result] = field(default_factory=list)

    def add(self, result: Result) -> None:
        self.results.append(result)

    def count(self, outcome: Outcome) -> int:
        return sum(r.outcome == outcome for r in self.results)

    @property
    def sent(self) -> int:
        return len(self.results)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.results)

    def latency_quantile(self, q: float) -> float | None:
        times = sorted(r.latency_s for r in self.results if r.outcome == "completed")
        if not times:
            return None
        return times[min(len(times) - 1, int(q * len(times)))]

    def summary(self) -> dict[str, Any]:
        p50, p99 = self.latency_quantile(0.5), self.latency_quantile(0.99)
        return {
            "sent": self.sent,
            "accepted": self.accepted,
            "completed": self.count("completed"),
            "retryable": self.count("retryable"),
            "lost": self.count("lost"),
            "p50_s": round(p50, 3) if p50 is not None else None,
            "p99_s": round(p99, 3) if p99 is not None else None,
            "client_saw": dict(Counter(f"{r.kind}: {r.saw}" for r in self.results)),
        }

    def lost_detail(self) -> list[str]:
        return [
            f"{r.kind} {r.saw} site={r.site} id={r.request_id}"
            for r in self.results
            if r.outcome == "lost"
        ]
