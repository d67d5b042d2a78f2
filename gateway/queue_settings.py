"""Settings of the gateway's queue: the requests it holds while every site pushes back (each
site's queue at GATEWAY_SITE_MAX_QUEUED_REQUESTS / _TOKENS), and the order it serves them in
(gateway/routing/hold_order.py; gateway/request_path/hold.py holds them).

Kept apart from gateway/settings.py (which nests it), as drift_settings.py is, and read by the
same field-driven reader (fedllm_contract/env_settings.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedllm_contract import spf
from fedllm_contract.env_settings import SettingsError, require_at_least, setting
from gateway.routing.hold_order import HOLD_POLICIES, HoldOrder, HoldPolicy


@dataclass(frozen=True, slots=True)
class QueueSettings:
    ENV_PREFIX: ClassVar[str] = "GATEWAY_QUEUE_"

    max_requests: int = setting(
        0,
        help="requests the gateway holds while every site's queue is at its bound, each until a "
        "site takes it or GATEWAY_QUEUE_TIMEOUT_S; beyond, and with 0 (none held), 503 with "
        "`Retry-After` at once",
    )
    timeout_s: float = setting(
        30.0, help="the longest a request is held before its 503 (`service_unavailable`)"
    )
    order: HoldPolicy = setting(
        "fcfs",
        help="the order held requests are offered to the sites in, within a priority class: "
        "`fcfs`, or `spf` (shortest predicted answer first, with aging: docs/routing.md)",
    )
    aging: float = setting(
        spf.DEFAULT_AGING,
        help="`spf`: tokens of rank a held request gains for each request held before it",
    )
    max_overtakes: int = setting(
        spf.DEFAULT_MAX_OVERTAKES,
        help="`spf`: at most this many requests held after one are served before it, however "
        "long its predicted answer",
    )
    poll_ms: int = setting(
        20, help="how often held requests are offered to the sites again while any is held"
    )

    def __post_init__(self) -> None:
        require_at_least(self, 0, "max_requests", "max_overtakes")
        require_at_least(self, 1, "poll_ms")
        if self.order not in HOLD_POLICIES:
            raise SettingsError(f"GATEWAY_QUEUE_ORDER must be one of {HOLD_POLICIES}")
        if self.timeout_s <= 0 or self.aging < 0:
            raise SettingsError("GATEWAY_QUEUE_TIMEOUT_S > 0 and GATEWAY_QUEUE_AGING >= 0")

    @property
    def hold_order(self) -> HoldOrder:
        return HoldOrder(self.order, self.aging, self.max_overtakes)
