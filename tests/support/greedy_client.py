"""A client that asks a key's limits again as soon as they let it, on a driven clock: what a
limit admits within any 60 s when every Retry-After is taken at its word (issue 48, finding 2:
fixed clock minutes let 1.6-1.7x a key's tokens per minute through over a minute boundary)."""

from __future__ import annotations

from gateway.tenancy.key_limits import InFlightRefusal, KeyLimits
from gateway.tenancy.keys import KeyRecord
from gateway.tenancy.limiter import Refusal


class Clock:
    def __init__(self, seconds: float) -> None:
        self.now = seconds

    def __call__(self) -> float:
        return self.now


async def greedy(
    limits: KeyLimits,
    key: KeyRecord,
    clock: Clock,
    seconds: float,
    charged: int,
    most: int | None = None,
    taken: int | None = None,
) -> list[tuple[float, int]]:
    """Requests charged `charged` tokens that may take `most` (prompt + max_tokens; default:
    what they are charged) and take `taken` (default: what they are charged), for `seconds` of
    the clock: the next one 10 ms after an admission (the last one has ended), or at the
    Retry-After of a refusal. Returns (time, tokens taken) of each one admitted."""
    most = charged if most is None else most
    taken = charged if taken is None else taken
    end = clock.now + seconds
    admitted: list[tuple[float, int]] = []
    while clock.now < end:
        held = await limits.admit(key, 1, charged, slot=False, most_tokens=most)
        if isinstance(held, InFlightRefusal):
            raise AssertionError("no concurrency cap here")
        if isinstance(held, Refusal):
            assert held.retry_after_s is not None, held
            clock.now += max(held.retry_after_s, 0.001)
            continue
        admitted.append((clock.now, taken))
        held.settle(taken)
        clock.now += 0.01
    return admitted


def most_in_any_window(admitted: list[tuple[float, int]], window_s: float = 60.0) -> int:
    """The most admitted within any `window_s` (each window starting at an admission)."""
    return max(
        sum(amount for at, amount in admitted if start <= at < start + window_s)
        for start, _ in admitted
    )
