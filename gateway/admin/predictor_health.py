"""The drift signal: each served model's predictor error over its recent traffic, kept fresh in
the background, shown on `/metrics` and the dashboard, and (GATEWAY_RETRAIN_ON_DRIFT) a retrain
job queued when a model drifts.

The rolling error is recomputed every GATEWAY_DRIFT_REFRESH_S from the length samples (one SQL
query for every model, then the arithmetic of gateway/prediction/drift.py) and cached: neither a
request nor a scrape ever waits on it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.db.models import utcnow
from gateway.drift_settings import DriftSettings, RetrainSettings
from gateway.metrics import GatewayMetrics
from gateway.prediction.drift import DriftRule, RollingError, rolling_error
from gateway.stores.load_history import Sessions
from gateway.stores.predictor_error import served_windows
from gateway.stores.retrain_jobs import JobAlreadyOpen, RetrainJobStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelHealth:
    model: str
    version: str | None  # the version the window's requests were predicted by
    error: RollingError | None
    drifted: bool
    reason: str

    def as_json(self) -> dict[str, object]:
        """What a retrain job keeps of the signal that asked for it."""
        return {"version": self.version, "reason": self.reason, **(error_json(self.error) or {})}


def rule_of(settings: DriftSettings) -> DriftRule:
    return DriftRule(settings.min_samples, settings.max_mae_ratio, settings.min_spearman)


def error_json(error: RollingError | None) -> dict[str, object] | None:
    """The error's numbers, rounded, with non-finite ratios as null (JSON has no infinity)."""
    if error is None:
        return None
    return {k: round(v, 4) if math.isfinite(v) else None for k, v in asdict(error).items()}


class PredictorHealth:
    def __init__(
        self,
        sessions: Sessions,
        models: list[str],
        drift: DriftSettings,
        retrain: RetrainSettings,
        jobs: RetrainJobStore,
    ) -> None:
        self._sessions = sessions
        self._models = models
        self._drift = drift
        self._retrain = retrain
        self._rule = rule_of(drift)
        self._jobs = jobs
        self._health: dict[str, ModelHealth] = {
            m: ModelHealth(m, None, None, False, "not computed yet") for m in models
        }
        self.refreshed_at: float | None = None

    def snapshot(self) -> dict[str, ModelHealth]:
        """The last computed health of every served model (no database access)."""
        return dict(self._health)

    async def refresh(self) -> dict[str, ModelHealth]:
        """Recomputes every model's window now; queues drift jobs when asked to."""
        since = None
        if self._drift.window_s > 0:
            since = utcnow() - timedelta(seconds=self._drift.window_s)
        windows = await served_windows(
            self._sessions,
            window_samples=self._drift.window_samples,
            since=since,
            include_censored=self._drift.include_censored,
        )
        health = {}
        for model in self._models:
            window = windows.get(model)
            error = rolling_error(window.pairs) if window is not None else None
            drifted, reason = self._rule.verdict(error)
            version = window.version if window is not None else None
            health[model] = ModelHealth(model, version, error, drifted, reason)
        self._health = health
        self.refreshed_at = utcnow().timestamp()
        if self._retrain.on_drift:
            for item in health.values():
                if item.drifted:
                    await self._queue_for_drift(item)
        return health

    async def _queue_for_drift(self, item: ModelHealth) -> None:
        latest = next(iter(await self._jobs.recent(1, item.model)), None)
        cooldown = timedelta(seconds=self._retrain.cooldown_s)
        if latest is not None and utcnow() - latest.created_at < cooldown:
            return  # an open job, or one recent enough that its result is what we are seeing
        try:
            job = await self._jobs.enqueue(
                item.model, reason="drift", mode=self._retrain.mode, drift=item.as_json()
            )
        except JobAlreadyOpen:
            return
        log.warning("predictor of %s drifted (%s): retrain job %d queued", item.model,
                    item.reason, job.id)  # fmt: skip

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # the last result stays shown; the next round tries again
                log.exception("could not compute the predictors' rolling error")
            await asyncio.sleep(self._drift.refresh_s)

    def watch(self, metrics: GatewayMetrics) -> None:
        metrics.registry.register(DriftCollector(self))


# (suffix, help, value of a window's error); absent for a model without a window.
_ERROR_GAUGES: tuple[tuple[str, str, Callable[[RollingError], float]], ...] = (
    ("rolling_mae_tokens", "MAE of expected tokens over the model's recent requests",
     lambda e: e.mae_tokens),
    ("rolling_served_mean_mae_tokens", "MAE of predicting the window's mean served length "
     "(the yardstick)", lambda e: e.served_mean_mae_tokens),
    ("rolling_mae_ratio", "rolling MAE / the served mean's MAE (>= 1: no better than a "
     "constant)", lambda e: e.mae_ratio),
    ("rolling_spearman", "rank correlation of predicted and true lengths over the window",
     lambda e: e.spearman),
)  # fmt: skip


class DriftCollector(Collector):
    """fedllm_gateway_predictor_* gauges per model, read from the last refresh when scraped."""

    def __init__(self, health: PredictorHealth) -> None:
        self._health = health

    def collect(self) -> Iterator[Metric]:
        snapshot = sorted(self._health.snapshot().values(), key=lambda h: h.model)
        for suffix, doc, value in _ERROR_GAUGES:
            family = GaugeMetricFamily(f"fedllm_gateway_predictor_{suffix}", doc,
                                       labels=("model",))  # fmt: skip
            for item in snapshot:
                if item.error is not None:
                    family.add_metric([item.model], float(value(item.error)))
            yield family
        samples = GaugeMetricFamily(
            "fedllm_gateway_predictor_rolling_samples",
            "finished requests in the model's window (predicted by the version serving it)",
            labels=("model",),
        )
        drifted = GaugeMetricFamily(
            "fedllm_gateway_predictor_drifted",
            "1 when the model's predictor is judged drifted (GATEWAY_DRIFT_*), else 0",
            labels=("model",),
        )
        for item in snapshot:
            samples.add_metric([item.model], float(item.error.samples if item.error else 0))
            drifted.add_metric([item.model], float(item.drifted))
        yield samples
        yield drifted
