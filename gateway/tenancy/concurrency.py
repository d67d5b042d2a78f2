"""Per-key requests in flight (in this process): the cap that keeps one client from holding every
slot with requests that run long, whatever their token charges say."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class InFlightCounter:
    _counts: dict[int, int] = field(default_factory=dict)

    def try_enter(self, key_id: int, limit: int | None) -> bool:
        count = self._counts.get(key_id, 0)
        if limit is not None and count >= limit:
            return False
        self._counts[key_id] = count + 1
        return True

    def leave(self, key_id: int) -> None:
        count = self._counts.get(key_id, 0) - 1
        if count > 0:
            self._counts[key_id] = count
        else:
            self._counts.pop(key_id, None)

    def in_flight(self, key_id: int) -> int:
        return self._counts.get(key_id, 0)


@dataclass(slots=True)
class Slot:
    """One request's place in its key's count, given back once: at settlement, or when the
    request is dropped without ever being settled (a stream the server never started)."""

    counter: InFlightCounter
    key_id: int
    held: bool = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.counter.leave(self.key_id)
