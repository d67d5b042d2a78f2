"""A cap on the uploads one gateway receives and validates at once: files and batches, each up
to tens of MiB held in memory while it is parsed and its requests tokenized. Over the cap the
caller gets 429 with Retry-After before its body is read. One key holds at most `per_key` of them
(GATEWAY_BATCH_UPLOADS_PER_KEY, one by default), so a few clients, slow or not, cannot take them
all; a body that stops arriving is cut by the connection's body deadline (GATEWAY_BODY_TIMEOUT_S,
gateway/api/http_protocol.py), which gives its slot back."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from gateway.errors import gateway_overloaded


@dataclass(slots=True)
class UploadGate:
    limit: int
    per_key: int = 1
    in_flight: int = 0
    _by_key: Counter[int | None] = field(default_factory=Counter)

    @contextmanager
    def admit(self, key_id: int | None) -> Iterator[None]:
        if self.in_flight >= self.limit:
            raise gateway_overloaded(
                f"this gateway is receiving its limit of {self.limit} batch uploads at once; "
                "retry shortly"
            )
        if self._by_key[key_id] >= self.per_key:
            raise gateway_overloaded(
                f"this key has {self.per_key} batch upload(s) in progress, its limit on this "
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
