"""How far under-predicted requests run a key past its tokens per minute (issue 32, finding 7),
driven with a clock through the gateway's own limiter (gateway/tenancy/limiter.py).

Clients loop on one key: a request is admitted with its prompt + predicted answer as its charge
and its prompt + max_tokens as the most it may take, runs for its answer's length at a decode
rate, and is settled to what it took; a refused client waits its Retry-After (1 to 5 s). Each
workload runs twice in the same run: with the bound (GATEWAY_TOKEN_LIMIT_OVERSHOOT 1.2) and
without it (the limiter before issue 32, the baseline). Figures per run:

- admitted: the most tokens taken by requests admitted within any 60 s, over the limit (the
  limiter's own accounting; the goal: at most 1.2);
- generated: the most tokens generated within any 60 s (each request's tokens spread over its
  run), over the limit;
- served: tokens served per minute over the whole run, over the limit (what the bound costs).

`python -m bench.security.token_overshoot` writes bench/results/security/token_overshoot.{json,md}.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from bench.common import markdown_table, results_dir, write_results
from gateway.tenancy.limiter import DEFAULT_OVERSHOOT, Charge, Limits, SlidingWindowLimiter

TICK_S = 0.1
WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class Ask:
    """One request as a client sends it: its prompt, the answer predicted, the answer it will
    really take, and max_tokens."""

    prompt: int
    predicted: int
    actual: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    limit: int
    clients: int
    minutes: float
    decode_tok_s: float
    ask: Callable[[random.Random], Ask]
    # A request every this many seconds instead of clients in a loop (an open-loop sender).
    every_s: float | None = None


@dataclass(slots=True)
class _Running:
    admitted_at: float
    ends_at: float
    charge: Charge
    ask: Ask
    client: int


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _max_window(events: list[tuple[float, float]], window_s: float = WINDOW_S) -> float:
    """The most `events` (time, amount) sum to within any `window_s`."""
    events.sort()
    best, total, start = 0.0, 0.0, 0
    for end in range(len(events)):
        total += events[end][1]
        while events[end][0] - events[start][0] >= window_s:
            total -= events[start][1]
            start += 1
        best = max(best, total)
    return best


def _senders(
    workload: Workload, tick: int, idle_until: list[float], running: list[_Running], now: float
) -> list[int]:
    """Who sends at this tick: the open-loop sender on its beat, or each idle client."""
    if workload.every_s is not None:
        return [0] if tick % round(workload.every_s / TICK_S) == 0 else []
    busy = {r.client for r in running}
    return [c for c in range(workload.clients) if idle_until[c] <= now and c not in busy]


def run(workload: Workload, overshoot: float, seed: int = 7) -> dict[str, float]:
    """The workload through the limiter; its figures over the key's limit."""
    rng, clock = random.Random(seed), _Clock()
    limiter = SlidingWindowLimiter(clock, overshoot=overshoot)
    limits = Limits(None, workload.limit)
    idle_until = [0.0] * workload.clients
    running: list[_Running] = []
    admitted: list[tuple[float, float]] = []
    generated: list[tuple[float, float]] = []
    served = 0
    horizon = workload.minutes * 60
    for tick in range(round(horizon / TICK_S)):
        clock.now = tick * TICK_S
        for run_ in [r for r in running if r.ends_at <= clock.now]:
            running.remove(run_)
            taken = run_.ask.prompt + run_.ask.actual
            limiter.settle(run_.charge, taken)
            served += taken
            idle_until[run_.client] = clock.now
        for client in _senders(workload, tick, idle_until, running, clock.now):
            ask = workload.ask(rng)
            charge = ask.prompt + min(ask.predicted, ask.max_tokens)
            outcome = limiter.admit(1, limits, 1, charge, ask.prompt + ask.max_tokens)
            if not isinstance(outcome, Charge):
                wait = outcome.retry_after_s if outcome.retry_after_s is not None else 5.0
                idle_until[client] = clock.now + min(max(wait, 1.0), 5.0)
                continue
            run_s = ask.actual / workload.decode_tok_s
            running.append(_Running(clock.now, clock.now + run_s, outcome, ask, client))
            admitted.append((clock.now, ask.prompt + ask.actual))
            steps = max(1, math.ceil(run_s / TICK_S))
            generated += [(clock.now + TICK_S * (i + 1), ask.actual / steps) for i in range(steps)]
    return {
        "admitted_x": _max_window(admitted) / workload.limit,
        "generated_x": _max_window(generated) / workload.limit,
        "served_x": served / (workload.limit * workload.minutes),
    }


def _issue_probe(rng: random.Random) -> Ask:
    # The issue's probe: ~142 tokens charged (prompt + prediction), 400 generated.
    return Ask(prompt=20, predicted=122, actual=400, max_tokens=400)


def _long_answers(rng: random.Random) -> Ask:
    # bench/security/limiter_outrun.py's requests: charged 30, taking 2,010 after 61 s.
    return Ask(prompt=10, predicted=20, actual=2_000, max_tokens=2_000)


def _chat_mix(rng: random.Random) -> Ask:
    # Chat-length answers (log-normal around 150 tokens, a tail to max_tokens) predicted with
    # a multiplicative error of sigma 0.8 (the served predictors' spread, README).
    max_tokens = 1024
    actual = min(max_tokens, max(1, round(rng.lognormvariate(math.log(150), 1.0))))
    predicted = max(1, round(actual * rng.lognormvariate(0.0, 0.8)))
    return Ask(round(rng.uniform(20, 400)), predicted, actual, max_tokens)


WORKLOADS = (
    Workload("issue probe: 700 tok/min, 4 clients", 700, 4, 10, 16.0, _issue_probe),
    Workload("issue probe, 16 clients", 700, 16, 10, 16.0, _issue_probe),
    Workload(
        "long answers: 10k tok/min, one every 0.1 s",
        10_000,
        1,
        10,
        33.0,
        _long_answers,
        every_s=0.1,
    ),
    Workload("chat mix: 10k tok/min, 32 clients", 10_000, 32, 10, 30.0, _chat_mix),
)


def main() -> None:
    rows, results = [], []
    for workload in WORKLOADS:
        for label, overshoot in (("bounded (1.2)", DEFAULT_OVERSHOOT), ("before", math.inf)):
            figures = run(workload, overshoot)
            results.append({"workload": workload.name, "limiter": label, **figures})
            rows.append(
                [workload.name, label, figures["admitted_x"], figures["generated_x"],
                 figures["served_x"]]
            )  # fmt: skip
    headers = ["workload", "limiter", "admitted in 60 s (x limit)",
               "generated in 60 s (x limit)", "served per minute (x limit)"]  # fmt: skip
    table = markdown_table(headers, rows)
    print(table)
    write_results(
        "token_overshoot",
        {"overshoot": DEFAULT_OVERSHOOT, "tick_s": TICK_S, "runs": results},
        table,
        "python -m bench.security.token_overshoot",
        results_dir("security"),
    )


if __name__ == "__main__":
    main()
