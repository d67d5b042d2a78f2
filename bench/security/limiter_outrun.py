"""The long-request escape from token limits (issue 20, finding 4), driven with a clock.

A 10k tokens/min key sends a request every 0.1 s; each is admitted with a 30-token charge
(prompt + an under-predicted answer) and ends 61 s later having taken 2,010 tokens, after its
charge left the 60 s window. Prints and writes the tokens served over 3 and 10 minutes and their
ratio to the limit: `python -m bench.security.limiter_outrun`.
"""

from __future__ import annotations

from bench.common import markdown_table, results_dir, write_results
from gateway.tenancy.limiter import Charge, Limits, SlidingWindowLimiter

LIMIT = 10_000
CHARGED, TAKEN, RUNS_S, EVERY_S = 30, 2_010, 61.0, 0.1


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def served_tokens(horizon_s: float) -> int:
    """Tokens of the requests that ended within `horizon_s`, all admitted by the limiter."""
    clock = _Clock()
    limiter = SlidingWindowLimiter(clock)
    running: list[tuple[float, Charge]] = []
    served = 0
    for tick in range(round(horizon_s / EVERY_S)):
        clock.now = tick * EVERY_S
        outcome = limiter.admit(1, Limits(None, LIMIT), 1, CHARGED)
        if isinstance(outcome, Charge):
            running.append((clock.now, outcome))
        while running and clock.now - running[0][0] >= RUNS_S:
            limiter.settle(running.pop(0)[1], TAKEN)
            served += TAKEN
    return served


def main() -> None:
    rows = []
    for horizon_s in (180.0, 600.0):
        served = served_tokens(horizon_s)
        rows.append([horizon_s, served, served / (LIMIT * horizon_s / 60)])
    table = markdown_table(["horizon s", "tokens served", "x the limit"], rows)
    print(table)
    write_results(
        "limiter_outrun",
        {"limit_tokens_per_minute": LIMIT, "rows": rows},
        table,
        "python -m bench.security.limiter_outrun",
        results_dir("security"),
    )


if __name__ == "__main__":
    main()
