"""What the admin API shows and does about the predictors: each served model's rolling error and
drift state with its last retrain job (GET /admin/api/predictors), retrain jobs asked for by an
operator (POST /admin/api/retrain-jobs) and the list of jobs.
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from gateway.admin.predictor_health import PredictorHealth, error_json
from gateway.drift_settings import RETRAIN_MODES, DriftSettings, RetrainSettings
from gateway.errors import Conflict, InvalidRequest, NotFound
from gateway.prediction.by_model import ModelPredictors
from gateway.stores.retrain_jobs import JobAlreadyOpen, JobRecord, RetrainJobStore


class RollingErrorView(msgspec.Struct, frozen=True):
    samples: int
    mae_tokens: float
    served_mean_mae_tokens: float
    mae_ratio: float | None  # null when every answer in the window had one length
    spearman: float
    mean_predicted_tokens: float
    mean_served_tokens: float


class RetrainJobView(msgspec.Struct, frozen=True):
    id: int
    model: str
    reason: str  # manual | drift
    mode: str  # calibrate | retrain
    state: str  # queued | running | done | failed
    created_at: float  # epoch seconds
    started_at: float | None
    finished_at: float | None
    version: str | None  # the candidate it registered
    activated: bool | None  # the activation gate's verdict (or --activate's override)
    decision: dict[str, object] | None
    error: str | None
    drift: dict[str, object] | None  # the rolling error that asked for it (reason drift)


class ModelPredictorView(msgspec.Struct, frozen=True):
    model: str
    serving_version: str | None  # what this gateway predicts the model with now
    window_version: str | None  # the version the window's requests were predicted by
    rolling: RollingErrorView | None
    drifted: bool
    # "drifted", "ok", or "not judged" (fewer samples than GATEWAY_DRIFT_MIN_SAMPLES: the
    # figures are shown, but no verdict is drawn from them).
    verdict: str
    reason: str
    last_job: RetrainJobView | None


class PredictorsView(msgspec.Struct, frozen=True):
    refreshed_at: float | None
    window_samples: int
    window_s: float
    min_samples: int
    max_mae_ratio: float
    min_spearman: float
    retrain_on_drift: bool
    models: list[ModelPredictorView]
    # Whether answers cut at max_tokens count in the window (GATEWAY_DRIFT_INCLUDE_CENSORED).
    include_censored: bool = False


class RetrainRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # In the body, not the path: engines' model names hold slashes (meta-llama/Llama-3-8B).
    model: str
    mode: str | None = None  # calibrate | retrain; default GATEWAY_RETRAIN_MODE


def _epoch(at: datetime | None) -> float | None:
    return round(at.timestamp(), 3) if at is not None else None


def _verdict(drifted: bool, rolling: dict[str, object] | None, min_samples: int) -> str:
    if drifted:
        return "drifted"
    samples = (rolling or {}).get("samples")
    judged = isinstance(samples, (int, float)) and samples >= min_samples
    return "ok" if judged else "not judged"


def job_view(job: JobRecord) -> RetrainJobView:
    return RetrainJobView(
        id=job.id, model=job.model, reason=job.reason, mode=job.mode, state=job.state,
        created_at=round(job.created_at.timestamp(), 3), started_at=_epoch(job.started_at),
        finished_at=_epoch(job.finished_at), version=job.version, activated=job.activated,
        decision=job.decision, error=job.error, drift=job.drift,
    )  # fmt: skip


class Retraining:
    def __init__(
        self,
        health: PredictorHealth,
        jobs: RetrainJobStore,
        predictors: ModelPredictors,
        drift: DriftSettings,
        retrain: RetrainSettings,
        models: list[str],
    ) -> None:
        self.health = health
        self.jobs = jobs
        self._predictors = predictors
        self._drift = drift
        self._retrain = retrain
        self._models = models

    async def predictors(self) -> PredictorsView:
        last_jobs = await self.jobs.latest_by_model()
        views = []
        for model, item in sorted(self.health.snapshot().items()):
            rolling = error_json(item.error)
            job = last_jobs.get(model)
            views.append(
                ModelPredictorView(
                    model=model,
                    serving_version=self._predictors.version(model),
                    window_version=item.version,
                    rolling=msgspec.convert(rolling, RollingErrorView) if rolling else None,
                    drifted=item.drifted,
                    verdict=_verdict(item.drifted, rolling, self._drift.min_samples),
                    reason=item.reason,
                    last_job=job_view(job) if job is not None else None,
                )
            )
        d = self._drift
        return PredictorsView(
            self.health.refreshed_at, d.window_samples, d.window_s, d.min_samples,
            d.max_mae_ratio, d.min_spearman, self._retrain.on_drift, views, d.include_censored,
        )  # fmt: skip

    async def enqueue(self, request: RetrainRequest) -> RetrainJobView:
        model = request.model
        if model not in self._models:
            raise NotFound(f"no served model named {model!r}", param="model",
                           code="model_not_found")  # fmt: skip
        mode = request.mode or self._retrain.mode
        if mode not in RETRAIN_MODES:
            raise InvalidRequest(f"mode must be one of {list(RETRAIN_MODES)}", param="mode")
        item = self.health.snapshot().get(model)
        drift = item.as_json() if item is not None and item.error is not None else None
        try:
            job = await self.jobs.enqueue(model, reason="manual", mode=mode, drift=drift)
        except JobAlreadyOpen as exc:
            raise Conflict(str(exc), param="model", code="retrain_job_open") from exc
        return job_view(job)

    async def recent_jobs(self, limit: int, model: str | None) -> list[RetrainJobView]:
        return [job_view(job) for job in await self.jobs.recent(limit, model)]

    async def job(self, job_id: int) -> RetrainJobView:
        job = await self.jobs.get(job_id)
        if job is None:
            raise NotFound(f"no retrain job {job_id}", param="id", code="retrain_job_not_found")
        return job_view(job)
