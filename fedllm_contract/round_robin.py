"""Work waiting by key (an API key, a site's tenant), taken round robin: each key's oldest item in
turn, so that one key's many or large items never hold another key's back (issue 75: the
gateway's file checks and a site's job intake were first come first served, and one key's
cancelled checks or 60 MiB job held another key's 8-line job for a minute and more).

Keys take turns in the order they came; a key served goes to the back of the line while it has
items left. Not thread-safe: its owner holds its own lock (a site's intake) or runs it on one
event loop (the gateway's checker).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class RoundRobin(Generic[K, T]):
    def __init__(self) -> None:
        self._line: deque[K] = deque()  # the keys with items, in the order they are served
        self._items: dict[K, deque[T]] = {}

    def __len__(self) -> int:
        return sum(len(items) for items in self._items.values())

    def __bool__(self) -> bool:
        return bool(self._items)

    def push(self, key: K, item: T) -> None:
        """`item` waits behind `key`'s others; a key new to the line joins its back."""
        items = self._items.get(key)
        if items is None:
            items = self._items[key] = deque()
            self._line.append(key)
        items.append(item)

    def requeue(self, key: K, item: T) -> None:
        """`item` had a turn and waits again: first of its key's, its key at the back of the
        line (the others' turns come first)."""
        if key in self._items:
            self._line.remove(key)
        else:
            self._items[key] = deque()
        self._items[key].appendleft(item)
        self._line.append(key)

    def pop(self) -> tuple[K, T]:
        """The next key's oldest item (IndexError when none waits)."""
        key = self._line.popleft()
        items = self._items[key]
        item = items.popleft()
        if items:
            self._line.append(key)
        else:
            del self._items[key]
        return key, item

    def remove(self, key: K, item: T) -> bool:
        """Takes `item` out of the line (False: it was not waiting)."""
        items = self._items.get(key)
        if items is None or item not in items:
            return False
        items.remove(item)
        if not items:
            del self._items[key]
            self._line.remove(key)
        return True

    def count(self, key: K) -> int:
        """How many of `key`'s items wait."""
        return len(self._items.get(key, ()))
