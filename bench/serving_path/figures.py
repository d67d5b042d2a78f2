"""The serving-path benchmark's figures from what the clients recorded and the CPU samples.

A window's delivered tokens: every answer's completion tokens (its usage chunk) spread over its
text events, so an answer open at a window's edge counts the share of its events that came
inside (clients.py notes each open answer's events at every window start). An answer cut off
has no usage: its events count at the mean tokens per event of the complete ones.

Per window: CPU µs per delivered token of each role, delivered tokens/s, the requests finished
(complete: `[DONE]` and a finish_reason), refused (an HTTP status other than 200, sent in the
window) and cut (ended otherwise in the window), TTFT of the answers whose first text came in
it, TPOT of those finished in it, and the mean tokens per text event of those.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.engine.metrics import percentile
from bench.serving_path.clients import Sent
from bench.serving_path.cpu_usage import Sample, Spent, spent

_REQUEST_ID = re.compile(r"\b(?:chat)?cmpl-[0-9a-f]+")


def quantile(values: Sequence[float], q: float) -> float | None:
    """bench.engine.metrics.percentile at q (0-1); None for no values."""
    return percentile(values, 100 * q) if values else None


def tokens_per_event(sent: Sequence[Sent]) -> float:
    """Mean tokens per text event over the complete answers (1.0 when none)."""
    tokens = sum(s.answer.tokens for s in sent if s.answer.complete)
    events = sum(s.answer.events for s in sent if s.answer.complete)
    return tokens / events if events else 1.0


def _events_by(item: Sent, window: int, edge: float) -> int:
    """Text events `item` had got at `edge`, the start of window `window`."""
    answer = item.answer
    if item.sent_s >= edge:
        return 0
    if window in answer.marks:
        return answer.marks[window]
    return answer.events  # ended before the edge


def _tokens(item: Sent, per_event: float) -> float:
    answer = item.answer
    return float(answer.tokens) if answer.complete else answer.events * per_event


def window_tokens(sent: Sequence[Sent], edges: Sequence[float], window: int) -> float:
    """Tokens delivered between edges[window] and edges[window + 1] (module docstring)."""
    per_event = tokens_per_event(sent)
    start, end = edges[window], edges[window + 1]
    total = 0.0
    for item in sent:
        answer = item.answer
        if not answer.events or item.sent_s >= end or (answer.end_s or end) < start:
            continue
        share = _events_by(item, window + 1, end) - _events_by(item, window, start)
        total += _tokens(item, per_event) * share / answer.events
    return total


def message_kind(text: str) -> str:
    """A refusal's message without the request's id, so that refusals of a kind count as one."""
    return _REQUEST_ID.sub("#", text)


def refusals(sent: Sequence[Sent]) -> dict[str, int]:
    """Refused and cut answers by what ended them (the start of the message)."""
    reasons: Counter[str] = Counter()
    for item in sent:
        answer = item.answer
        if item.cut or answer.complete:
            continue
        text = message_kind(answer.error or "ended without [DONE] or a finish_reason")[:160]
        reasons[f"HTTP {answer.status}: {text}" if answer.status else text] += 1
    return dict(reasons.most_common(12))


@dataclass(frozen=True, slots=True)
class Roles:
    """Which sampled roles are servers (their CPU per token is the figure) and which are not."""

    servers: tuple[str, ...] = ("site", "gateway")
    others: tuple[str, ...] = ("clients",)


def _ttft(item: Sent, start: float, end: float) -> float | None:
    """Its time to first text if that text came between start and end."""
    first = item.answer.first_s
    return first - item.sent_s if first is not None and start <= first < end else None


def _tpot(item: Sent) -> float | None:
    answer = item.answer
    if answer.first_s is None or answer.end_s is None or answer.tokens < 2:
        return None
    return (answer.end_s - answer.first_s) / (answer.tokens - 1)


def window_figures(
    sent: Sequence[Sent],
    samples: Sequence[Sample],
    edges: Sequence[float],
    window: int,
    roles: Roles = Roles(),
) -> dict[str, Any]:
    """One window's figures (module docstring): from edges[window] to edges[window + 1] (the
    clients' marks), CPU from samples[window] to samples[window + 1] (taken at those edges)."""
    before, after = samples[window], samples[window + 1]
    start, end = edges[window], edges[window + 1]
    wall = after.at_s - before.at_s
    tokens = window_tokens(sent, edges, window)
    ended = [s for s in sent if s.answer.end_s is not None and start <= s.answer.end_s < end]
    done = [s for s in ended if s.answer.complete]
    ttft = [t for s in sent if (t := _ttft(s, start, end)) is not None]
    tpot = [t for s in done if (t := _tpot(s)) is not None]
    events = sum(s.answer.events for s in done)
    out: dict[str, Any] = {
        "wall_s": wall,
        "delivered_tokens": tokens,
        "delivered_tokens_per_s": tokens / (end - start),
        "finished": len(done),
        "refused": sum(start <= s.sent_s < end and s.answer.status not in (0, 200) for s in sent),
        "cut": sum(not s.answer.complete and s.answer.status in (0, 200) for s in ended),
        "ttft_p50_s": quantile(ttft, 0.5),
        "ttft_p99_s": quantile(ttft, 0.99),
        "tpot_p50_s": quantile(tpot, 0.5),
        "tokens_per_chunk": sum(s.answer.tokens for s in done) / events if events else None,
    }
    for role in (*roles.servers, *roles.others):
        if role in before.roles:
            out |= _role_figures(
                spent(before, after, role), role, tokens, wall, role in roles.servers
            )
    return out


def _role_figures(
    used: Spent, role: str, tokens: float, wall: float, server: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {
        f"{role}_cpu_us_per_token": 1e6 * used.cpu_s / tokens if tokens else None,
        f"{role}_cores": used.cores(wall),
    }
    if server:
        out[f"{role}_loop_busy"] = used.main_thread_s / wall
        # The busiest threads' cores (the loop's and the engine's or gRPC's poller among them).
        out[f"{role}_threads_cores"] = [round(s / wall, 3) for s in used.threads.values()][:4]
    return out


def spread(windows: Sequence[dict[str, Any]], key: str) -> dict[str, float | None]:
    """The median of the windows' values of `key`, with their min and max."""
    values = sorted(w[key] for w in windows if w.get(key) is not None)
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": values[len(values) // 2], "min": values[0], "max": values[-1]}
