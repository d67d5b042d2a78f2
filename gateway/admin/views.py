"""Wire schemas of the admin API (/admin/api/*), columnar where they carry time series.

Series are aligned on `start + i * step_s` (epoch seconds, bucket starts) for i < points; a
bucket without data is null. Values are rounded where they leave the gateway, so the page shows
exactly what the API says.
"""

from __future__ import annotations

import msgspec


class Policy(msgspec.Struct, frozen=True):
    routing: str
    offload: bool


class LoadNow(msgspec.Struct, frozen=True, kw_only=True):
    """A site's load now, or a cloud's (the sum over its sites)."""

    # Live, from the last load reports: token load = queued + running + predicted.
    queued_tokens: int
    running_tokens: int
    predicted_remaining_tokens: int
    token_load: int
    queued_requests: int
    running_requests: int
    # Requests completed over the last `recent_s` seconds, and their mean latencies.
    completed_recent: int
    requests_per_min: float
    ttft_ms: float | None
    e2e_ms: float | None


class SiteNow(LoadNow, frozen=True, kw_only=True):
    name: str
    cloud: str
    region: str
    model: str
    healthy: bool
    last_error: str | None
    # This gateway's own view: its requests in flight there and their planned tokens.
    in_flight: int
    ledger_tokens: int
    # An operator is draining the site (POST /admin/api/sites/{name}/drain).
    draining: bool = False
    # Its kind (grpc, openai) and whether its queued work can be released for offload (an
    # OpenAI-compatible engine owns its queue: it cannot).
    kind: str = "grpc"
    can_release_queued: bool = True
    # Of the prompt tokens the site looked up in its prefix cache since it started, the share
    # it found cached (either tier); None before it looked any up, or when it cannot say.
    prefix_cache_hit_rate: float | None = None
    # Its LoRA adapters in device slots and only in host memory, as its last load report says
    # (the others it serves are on disk), sorted.
    adapters_on_device: tuple[str, ...] = ()
    adapters_in_host: tuple[str, ...] = ()


class CloudNow(LoadNow, frozen=True, kw_only=True):
    cloud: str
    sites: int
    healthy_sites: int


class Overview(msgspec.Struct, frozen=True):
    at: float  # epoch seconds of the snapshot
    recent_s: int
    sample_interval_s: float
    policy: Policy
    clouds: list[CloudNow]
    sites: list[SiteNow]
    offloads_recent: int  # offloads over the last `recent_s` seconds
    # Epoch seconds of the oldest history kept (None: none yet): the page opens on the
    # shortest window that shows all of it.
    history_since: float | None = None


class Series(msgspec.Struct, frozen=True):
    key: str  # the cloud or site name
    kind: str  # "cloud" | "site"
    token_load: list[int | None]
    queued_tokens: list[int | None]
    running_tokens: list[int | None]
    predicted_remaining_tokens: list[int | None]
    queued_requests: list[float | None]
    running_requests: list[float | None]
    completed: list[int | None]
    requests_per_min: list[float | None]
    ttft_ms: list[float | None]
    e2e_ms: list[float | None]
    healthy_fraction: list[float | None]


class History(msgspec.Struct, frozen=True):
    start: int
    step_s: int
    points: int
    series: list[Series]


class DriftSeries(msgspec.Struct, frozen=True):
    site: str
    model: str
    count: list[int | None]
    mean_predicted: list[float | None]
    mean_actual: list[float | None]
    bias: list[float | None]  # mean(predicted - actual) tokens
    mae: list[float | None]  # mean |predicted - actual| tokens


class DriftSummary(msgspec.Struct, frozen=True):
    site: str
    model: str
    count: int
    mean_predicted: float
    mean_actual: float
    bias: float
    mae: float


class Drift(msgspec.Struct, frozen=True):
    start: int
    step_s: int
    points: int
    series: list[DriftSeries]
    summary: list[DriftSummary]


class OffloadView(msgspec.Struct, frozen=True):
    at: float
    request_id: str
    from_site: str | None
    to_site: str | None


class Offloads(msgspec.Struct, frozen=True):
    since: float
    total: int
    events: list[OffloadView]


class SiteDetail(msgspec.Struct, frozen=True):
    site: SiteNow
    history: History
    drift: Drift
    offloads: Offloads
