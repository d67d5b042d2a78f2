"""An endless, seeded stream of chat-shaped requests for the host-side benches
(bench/engine/host_step.py, bench/engine/scheduler_overhead.py): short prompts (log-normal,
median 60 tokens, p99 600), a share of them drawn with repeats from a few shared prompts so the
prefix cache hits, and answers of log-normal length (median 250 tokens, p99 1,024: ShareGPT-like).
The same seed gives the same stream, so every arm of a bench sees the same requests."""

from __future__ import annotations

import math
import random

# The standard normal's 99th percentile: a log-normal's sigma from its median and p99.
_Z99 = 2.3263478740408408


def lognormal(rng: random.Random, median: float, p99: float, cap: int) -> int:
    sigma = math.log(p99 / median) / _Z99
    return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))


class ChatStream:
    def __init__(
        self,
        seed: int,
        shared_prompts: int,
        repeat_fraction: float,
        prompt_cap: int,
        tokens: range,
    ) -> None:
        """`tokens`: the ids prompts are drawn from; `prompt_cap`: the longest prompt."""
        self._rng = random.Random(seed)
        self._repeat = repeat_fraction
        self._cap, self._tokens = prompt_cap, tokens
        self._shared = [self._prompt() for _ in range(shared_prompts)]
        self._count = 0

    def _prompt(self) -> tuple[int, ...]:
        length = lognormal(self._rng, 60, 600, self._cap)
        start, stop = self._tokens.start, self._tokens.stop
        return tuple(self._rng.randrange(start, stop) for _ in range(length))

    def next(self) -> tuple[str, tuple[int, ...], int]:
        """(request id, prompt, answer length)."""
        self._count += 1
        shared = self._rng.random() < self._repeat
        prompt = self._rng.choice(self._shared) if shared else self._prompt()
        return f"r{self._count}", prompt, lognormal(self._rng, 250, 1024, 1024)
