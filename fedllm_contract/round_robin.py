"""Work waiting by key (an API key, a site's tenant), taken round robin: each key's oldest item in
turn, so that one key's many or large items never hold another key's back (issue 75: the
gateway's file checks and a site's job intake were first come first served, and one key's
cancelled checks or 60 MiB job held another key's 8-line job for a minute and more).

The next item is the oldest of the key served least recently: a key never served (or not for
the last REMEMBERED keys' turns) first, in the order keys came. A key whose item just had a turn
so waits behind every other waiting key, even one whose item came after its next: with one
worker, another key's check waits for one check of each key ahead of it at most. Not
thread-safe: its owner holds its own lock (a site's intake) or runs it on one event loop (the
gateway's checker).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
# How many keys' last turns are remembered: a key served longer ago counts as never served.
REMEMBERED = 4096


class RoundRobin(Generic[K, T]):
    def __init__(self) -> None:
        self._items: dict[K, deque[T]] = {}  # the keys with items, in the order they came
        self._served: OrderedDict[K, None] = OrderedDict()  # least recently served first

    def __len__(self) -> int:
        return sum(len(items) for items in self._items.values())

    def __bool__(self) -> bool:
        return bool(self._items)

    def push(self, key: K, item: T) -> None:
        """`item` waits behind `key`'s others."""
        self._items.setdefault(key, deque()).append(item)

    def requeue(self, key: K, item: T) -> None:
        """`item` had a turn and waits again, first of its key's (whose turn comes after the
        other keys', it having just been served)."""
        self._items.setdefault(key, deque()).appendleft(item)

    def pop(self) -> tuple[K, T]:
        """The oldest item of the key served least recently (IndexError when none waits)."""
        if not self._items:
            raise IndexError("nothing waits")
        fresh = [k for k in self._items if k not in self._served]
        # A key may be None (the gateway's callers without a key): chosen from lists, not by
        # a None standing for "none found".
        key = fresh[0] if fresh else next(k for k in self._served if k in self._items)
        items = self._items[key]
        item = items.popleft()
        if not items:
            del self._items[key]
        self._served.pop(key, None)
        self._served[key] = None
        if len(self._served) > REMEMBERED:
            self._served.popitem(last=False)
        return key, item

    def remove(self, key: K, item: T) -> bool:
        """Takes `item` out of the line (False: it was not waiting)."""
        items = self._items.get(key)
        if items is None or not any(waiting is item for waiting in items):
            return False
        self._items[key] = deque(waiting for waiting in items if waiting is not item)
        if not self._items[key]:
            del self._items[key]
        return True

    def count(self, key: K) -> int:
        """How many of `key`'s items wait."""
        return len(self._items.get(key, ()))
