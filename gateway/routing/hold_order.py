"""The order of the requests the gateway holds while every site pushes back (its queue: the
request path's gateway/request_path/hold.py, and fedsim's simulated gateway).

Priority classes first (fedllm_contract/priority.py: interactive, flex, batch), as at the sites;
within a class "fcfs" serves in arrival order and "spf" by the shared rule of
fedllm_contract/spf.py: the planned answer length (the prediction, else what routing plans
without one) plus aging per earlier arrival, the length capped so that at most `max_overtakes`
requests that came later are served before any held request. A rank is fixed when the request
is held, so each class is a list kept sorted by binary insertion (no sort per offer).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar, get_args

from fedllm_contract import spf
from fedllm_contract.priority import Priority
from gateway.routing.filters import QueueBoundFilter
from gateway.routing.profile import Decision

_QUEUE_BOUND = QueueBoundFilter().name
HoldPolicy = Literal["fcfs", "spf"]
HOLD_POLICIES: tuple[str, ...] = get_args(HoldPolicy)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class HoldOrder:
    """How held requests are ordered within a class (the module docstring)."""

    policy: HoldPolicy = "fcfs"
    aging: float = spf.DEFAULT_AGING
    max_overtakes: int | None = spf.DEFAULT_MAX_OVERTAKES

    def __post_init__(self) -> None:
        if self.policy not in HOLD_POLICIES:
            raise ValueError(f"queue order must be one of {HOLD_POLICIES}, got {self.policy!r}")
        if self.aging < 0:
            raise ValueError(f"queue aging must be >= 0, got {self.aging}")
        spf.length_cap(self.aging, self.max_overtakes)  # a bound < 0 is refused


@dataclass(slots=True, eq=False)
class Held(Generic[T]):
    """One held request: the caller's item, its class, and its place (arrival index, rank)."""

    item: T
    priority: Priority
    index: int
    rank: float
    held: bool = field(default=True)

    @property
    def key(self) -> tuple[float, int]:
        return (self.rank, self.index)


class HeldRequests(Generic[T]):
    """Contract: `hold` places an item by HoldOrder, `release` takes one out (ValueError if it
    is not held), iteration yields the held items' entries in serving order, classes from the
    top; `arrivals` counts every item ever held (the arrival index of the next)."""

    def __init__(self, order: HoldOrder) -> None:
        self.order = order
        self._cap = spf.length_cap(order.aging, order.max_overtakes)
        self._spf = order.policy == "spf"
        self._keys: dict[Priority, list[tuple[float, int]]] = {p: [] for p in Priority}
        self._held: dict[Priority, list[Held[T]]] = {p: [] for p in Priority}
        self.arrivals = 0

    def hold(self, item: T, priority: Priority, planned_tokens: int) -> Held[T]:
        """Hold `item`, whose answer is planned at `planned_tokens` (>= 1 counts: 0 ranks 1)."""
        index = self.arrivals
        self.arrivals += 1
        aging, spf_order = self.order.aging, self._spf
        rank = spf.rank(max(planned_tokens, 1), index, aging, self._cap) if spf_order else 0.0
        entry = Held(item, priority, index, rank)
        keys, held = self._keys[priority], self._held[priority]
        key = entry.key
        if not keys or keys[-1] < key:
            keys.append(key)  # FCFS always, SPF often: the newest is the last
            held.append(entry)
        else:
            at = bisect_left(keys, key)
            keys.insert(at, key)
            held.insert(at, entry)
        return entry

    def release(self, entry: Held[T]) -> None:
        keys, held = self._keys[entry.priority], self._held[entry.priority]
        at = bisect_left(keys, entry.key)
        if not entry.held or at == len(keys) or held[at] is not entry:
            raise ValueError(f"request {entry.index} is not held")
        del keys[at]
        del held[at]
        entry.held = False

    def __iter__(self) -> Iterator[Held[T]]:
        """Every held entry in serving order; a snapshot (releasing while iterating is safe)."""
        for priority in Priority:
            yield from list(self._held[priority])

    def __len__(self) -> int:
        return sum(len(held) for held in self._held.values())

    def __bool__(self) -> bool:
        return any(self._held.values())


def offer(
    held: HeldRequests[T],
    place: Callable[[T], bool],
    group: Callable[[T], Hashable],
) -> list[Held[T]]:
    """Offers the held requests to the sites in serving order: `place(item)` routes one and
    takes its site (True), or finds none (False). A request finding none holds back the later
    ones of its group (the same model and adapter: the same sites, all pushing back), not the
    others'. The placed entries, released, in the order they were placed."""
    placed: list[Held[T]] = []
    blocked: set[Hashable] = set()
    for entry in held:
        key = group(entry.item)
        if key in blocked:
            continue
        if place(entry.item):
            held.release(entry)
            placed.append(entry)
        else:
            blocked.add(key)
    return placed


def most_overtaken(served: Sequence[Held[T]]) -> int:
    """The most requests that were held after one and served before it, within its class, over
    `served` in the order served (the bound HoldOrder.max_overtakes keeps under SPF)."""
    return max_inversions((entry.priority, entry.index) for entry in served)


def max_inversions(served: Iterable[tuple[Hashable, int]]) -> int:
    """Over (class, arrival index) pairs in serving order: the most later arrivals of the same
    class served before any one of them."""
    seen: dict[Hashable, list[int]] = {}
    worst = 0
    for cls, index in served:
        earlier = seen.setdefault(cls, [])
        worst = max(worst, len(earlier) - bisect_right(earlier, index))
        insort(earlier, index)
    return worst


def pushed_back(decision: Decision[T]) -> bool:
    """Whether no site took a request because every site that could serve it has its queue at
    the gateway's bound (the queue bound filter was the first to leave none), not because none
    serves it, none is healthy, or none has the room."""
    for name, left in decision.survivors:
        if left == 0:
            return name == _QUEUE_BOUND
    return False
