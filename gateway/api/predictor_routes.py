"""The predictors' drift signal and retrain jobs in the admin API, operators only.

- GET  /admin/api/predictors                     per served model: rolling error, drift, last job
- POST /admin/api/retrain-jobs                   queue a retrain job ({"model", "mode"?})
- GET  /admin/api/retrain-jobs?model&limit       recent jobs, newest first
- GET  /admin/api/retrain-jobs/{id}              one job: its state, version and gate decision
"""

from __future__ import annotations

from typing import Annotated, Any

from litestar import Controller, Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import Parameter

from gateway.admin.retraining import PredictorsView, Retraining, RetrainJobView, RetrainRequest
from gateway.api.admin_auth import require_admin
from gateway.api.admin_routes import json_response
from gateway.api.body import decode_body
from gateway.api.openapi_body import json_body
from gateway.api.row_ids import row_id

Limit = Annotated[int, Parameter(ge=1, le=500)]
JobId = Annotated[int, row_id("job")]
Model = Annotated[str | None, Parameter(description="one served model's jobs")]


class PredictorAdminController(Controller):
    path = "/api"
    tags = ("admin",)
    guards = [require_admin]  # noqa: RUF012 (litestar's)

    @get("/predictors", summary="Each served model's predictor error on recent traffic")
    async def predictors(
        self, request: Request[Any, Any, Any], retraining: NamedDependency[Retraining]
    ) -> Response[bytes]:
        view: PredictorsView = await retraining.predictors()
        return json_response(request, view)

    @post(
        "/retrain-jobs",
        status_code=202,
        summary="Queue a retrain job for a served model's predictor",
        operation_class=json_body(RetrainRequest),
    )
    async def retrain(
        self, request: Request[Any, Any, Any], retraining: NamedDependency[Retraining]
    ) -> RetrainJobView:
        return await retraining.enqueue(decode_body(await request.body(), RetrainRequest))

    @get("/retrain-jobs", summary="Recent retrain jobs, newest first")
    async def jobs(
        self,
        request: Request[Any, Any, Any],
        retraining: NamedDependency[Retraining],
        limit: Limit = 50,
        model: Model = None,
    ) -> Response[bytes]:
        return json_response(request, await retraining.recent_jobs(limit, model))

    @get("/retrain-jobs/{job_id:int}", summary="One retrain job")
    async def job(self, retraining: NamedDependency[Retraining], job_id: JobId) -> RetrainJobView:
        return await retraining.job(job_id)
