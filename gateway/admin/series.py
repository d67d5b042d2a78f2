"""Turns downsampled buckets from the database into the dashboard's columnar series.

Per-cloud series add up their sites bucket by bucket: token and request gauges (each a site's
average over the bucket) and completions sum; latencies combine weighted by completions, so a
cloud's latency is the mean over all its completed requests, not a mean of site means.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from gateway.admin.views import Drift, DriftSeries, DriftSummary, Series
from gateway.stores.load_history import SiteBucket, SiteRef, Window
from gateway.stores.request_history import DriftBucket


@dataclass(slots=True)
class _Acc:
    """Sums over the site buckets of one series and bucket."""

    sites: int = 0
    queued_tokens: float = 0.0
    running_tokens: float = 0.0
    predicted: float = 0.0
    queued_requests: float = 0.0
    running_requests: float = 0.0
    completed: int = 0
    ttft_weighted: float = 0.0
    ttft_weight: int = 0
    e2e_weighted: float = 0.0
    e2e_weight: int = 0
    healthy: float = 0.0

    def add(self, b: SiteBucket) -> None:
        """Adds one site's bucket: its gauges as averages over its samples."""
        n = b.samples
        self.sites += 1
        self.queued_tokens += b.queued_tokens_sum / n
        self.running_tokens += b.running_tokens_sum / n
        self.predicted += b.predicted_remaining_tokens_sum / n
        self.queued_requests += b.queued_requests_sum / n
        self.running_requests += b.running_requests_sum / n
        self.completed += b.completed_requests
        self.ttft_weighted += b.ttft_ms_weighted
        self.ttft_weight += b.ttft_weight
        self.e2e_weighted += b.e2e_ms_weighted
        self.e2e_weight += b.e2e_weight
        self.healthy += b.healthy_samples / n


@dataclass(slots=True)
class _Columns:
    points: int
    step_s: int
    accs: dict[int, _Acc] = field(default_factory=dict)

    def add(self, b: SiteBucket) -> None:
        if 0 <= b.index < self.points:
            self.accs.setdefault(b.index, _Acc()).add(b)

    def series(self, key: str, kind: str) -> Series:
        n = self.points

        def ints(get: Callable[[_Acc], float]) -> list[int | None]:
            out: list[int | None] = [None] * n
            for i, a in self.accs.items():
                out[i] = round(get(a))
            return out

        def floats(get: Callable[[_Acc], float | None], digits: int) -> list[float | None]:
            out: list[float | None] = [None] * n
            for i, a in self.accs.items():
                value = get(a)
                out[i] = None if value is None else round(value, digits)
            return out

        per_min = 60.0 / self.step_s
        return Series(
            key=key,
            kind=kind,
            token_load=ints(lambda a: a.queued_tokens + a.running_tokens + a.predicted),
            queued_tokens=ints(lambda a: a.queued_tokens),
            running_tokens=ints(lambda a: a.running_tokens),
            predicted_remaining_tokens=ints(lambda a: a.predicted),
            queued_requests=floats(lambda a: a.queued_requests, 2),
            running_requests=floats(lambda a: a.running_requests, 2),
            completed=ints(lambda a: a.completed),
            requests_per_min=floats(lambda a: a.completed * per_min, 2),
            ttft_ms=floats(lambda a: _ratio(a.ttft_weighted, a.ttft_weight), 1),
            e2e_ms=floats(lambda a: _ratio(a.e2e_weighted, a.e2e_weight), 1),
            healthy_fraction=floats(lambda a: a.healthy / a.sites, 3),
        )


def _ratio(total: float, weight: int) -> float | None:
    return total / weight if weight else None


def cloud_series(
    buckets: Iterable[SiteBucket], sites: dict[int, SiteRef], window: Window
) -> list[Series]:
    clouds: dict[str, _Columns] = {}
    for ref in sites.values():
        clouds.setdefault(ref.cloud, _Columns(window.points, window.step_s))
    for b in buckets:
        owner = sites.get(b.site_id)
        if owner is not None:
            clouds[owner.cloud].add(b)
    return [cols.series(cloud, "cloud") for cloud, cols in sorted(clouds.items())]


def site_series(buckets: Iterable[SiteBucket], site: SiteRef, window: Window) -> Series:
    cols = _Columns(window.points, window.step_s)
    for b in buckets:
        if b.site_id == site.site_id:
            cols.add(b)
    return cols.series(site.name, "site")


def drift(
    buckets: Sequence[DriftBucket], sites: dict[int, SiteRef], window: Window, series: bool = True
) -> Drift:
    """Series per site and model (unless `series` is false: the buckets then cover the whole
    window) and a summary over the window, both from the same sums."""
    grouped: defaultdict[tuple[str, str], list[DriftBucket]] = defaultdict(list)
    for b in buckets:
        ref = sites.get(b.site_id)
        if ref is not None and 0 <= b.index < window.points:
            grouped[(ref.name, b.model)].append(b)
    out, summary = [], []
    for (site, model), rows in sorted(grouped.items()):
        n = window.points
        count: list[int | None] = [None] * n
        predicted: list[float | None] = [None] * n
        actual: list[float | None] = [None] * n
        bias: list[float | None] = [None] * n
        mae: list[float | None] = [None] * n
        for b in rows:
            count[b.index] = b.count
            predicted[b.index] = round(b.predicted_sum / b.count, 1)
            actual[b.index] = round(b.actual_sum / b.count, 1)
            bias[b.index] = round(b.error_sum / b.count, 1)
            mae[b.index] = round(b.abs_error_sum / b.count, 1)
        if series:
            out.append(DriftSeries(site, model, count, predicted, actual, bias, mae))
        total = sum(b.count for b in rows)
        summary.append(
            DriftSummary(
                site=site,
                model=model,
                count=total,
                mean_predicted=round(sum(b.predicted_sum for b in rows) / total, 1),
                mean_actual=round(sum(b.actual_sum for b in rows) / total, 1),
                bias=round(sum(b.error_sum for b in rows) / total, 1),
                mae=round(sum(b.abs_error_sum for b in rows) / total, 1),
            )
        )
    return Drift(window.start_s, window.step_s, window.points, out, summary)
