"""How fast a site decodes and prefills, measured over its recent engine steps: the rates its load
reports carry, from which the gateway reads its step time and its prefill speed
(gateway/routing/latency.py, gateway/routing/completion_cost.py).

Both rates leave idle time out (tokens over the time of the steps that did the work): a site that
had just answered a short request once read as many times slower than it steps. And each rate
counts only the steps that did its kind of work. A step in which nothing was decoding yet (a lone
request's prefill) says nothing about the decode step: counted, it made the site that had just
prefilled a conversation's first turn look slower than its peers, so the next turn left the site
that held its prefix. A step that both decodes and prefills (chunked prefill next to running
sequences) counts for both: the sequences decoding waited the whole step, and so did the chunk.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Steps older than this (seconds) no longer count.
RATE_WINDOW_S = 2.0


@dataclass(frozen=True, slots=True)
class StepWork:
    """One engine step: when it ended (monotonic seconds) and how long it took, the tokens it
    decoded (outputs of sequences past their first token), whether any sequence was decoding when
    it began, and the prompt tokens it computed."""

    ended: float
    busy_s: float
    decoded: int
    decoding: bool
    prefilled: int


@dataclass(slots=True)
class StepRates:
    """Contract: `add` takes each step as it ends (engine thread); `decode_tokens_per_s(now)` is
    the tokens decoded by the steps of the last RATE_WINDOW_S seconds during which a sequence was
    decoding, over the time those steps took; `prefill_tokens_per_s(now)` the prompt tokens
    computed over the time of the steps that computed some. Each is 0.0 when no such step is in
    the window. Safe to read from another thread than the one that adds."""

    window_s: float = RATE_WINDOW_S
    steps: deque[StepWork] = field(default_factory=deque)

    def add(self, step: StepWork) -> None:
        self.steps.append(step)
        while self.steps and step.ended - self.steps[0].ended > self.window_s:
            self.steps.popleft()

    def decode_tokens_per_s(self, now: float) -> float:
        recent = [s for s in self._recent(now) if s.decoding]
        return _rate(sum(s.decoded for s in recent), sum(s.busy_s for s in recent))

    def prefill_tokens_per_s(self, now: float) -> float:
        recent = [s for s in self._recent(now) if s.prefilled > 0]
        return _rate(sum(s.prefilled for s in recent), sum(s.busy_s for s in recent))

    def _recent(self, now: float) -> list[StepWork]:
        # tuple() copies the deque in one C call under the GIL while the engine thread appends:
        # iterating it directly raised "deque mutated during iteration" and broke the load stream.
        return [s for s in tuple(self.steps) if now - s.ended <= self.window_s]


def _rate(tokens: int, busy_s: float) -> float:
    return tokens / busy_s if tokens > 0 and busy_s > 0 else 0.0
