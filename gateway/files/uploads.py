"""A cap on the uploads one gateway receives and validates at once: files and batches, each up
to tens of MiB held in memory while it is parsed and its requests tokenized. Over the cap the
caller gets 429 with Retry-After before its body is read. One key holds at most half the slots
(at least one), so a single client, slow or not, cannot take them all."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from gateway.errors import gateway_overloaded


@dataclass(slots=True)
class UploadGate:
    limit: int
    in_flight: int = 0
    _by_key: Counter[int | None] = field(default_factory=Counter)

    @property
    def per_key(self) -> int:
        return max(1, self.limit // 2)

    @contextmanager
    def admit(self, key_id: int | None) -> Iterator[None]:
        if self.in_flight >= self.limit:
            raise gateway_overloaded(
                f"this gateway is receiving its limit of {self.limit} batch uploads at once; "
                "retry shortly"
            )
        if self._by_key[key_id] >= self.per_key:
            raise gateway_overloaded(
                f"this key has {self.per_key} batch uploads in progress, its limit on this "
                "gateway; retry when one ends"
            )
        self.in_flight += 1
        self._by_key[key_id] += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            self._by_key[key_id] -= 1
            if not self._by_key[key_id]:
                del self._by_key[key_id]
