"""Readiness: whether the database answers and a site is healthy (/readyz, for anyone: a load
balancer needs no more), and the report of what serves (/admin/api/readiness, operators only:
it names the sites, the drains, the request log's backlog and the predictors' versions)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.admin.drain import SiteDrainer
from gateway.prediction.by_model import ModelPredictors
from gateway.sites.registry import SiteRegistry
from gateway.stores.predictor_registry import DEFAULT_MODEL
from gateway.stores.request_writer import RequestLogWriter


class Readiness:
    def __init__(
        self,
        registry: SiteRegistry,
        sessions: async_sessionmaker[AsyncSession],
        predictors: ModelPredictors,
        drainer: SiteDrainer,
        request_log: RequestLogWriter,
        served_models: Sequence[str] = (),
    ) -> None:
        self._registry = registry
        self._served_models = tuple(served_models)
        self._request_log = request_log
        self._sessions = sessions
        self._predictors = predictors
        self._drainer = drainer

    async def ready(self) -> bool:
        """True when the database answers and at least one site is healthy."""
        healthy = any(site.healthy for site in self._registry.all())
        return healthy and await self._database() == "ok"

    async def _database(self) -> str:
        try:
            async with self._sessions() as session:
                await session.execute(text("SELECT 1"))
        except Exception as exc:  # any failure means not ready; the reason is reported
            return f"error: {type(exc).__name__}"
        return "ok"

    async def report(self) -> dict[str, object]:
        """`ready` as ready() says, with what it was judged on and what serves."""
        sites = {site.name: site.healthy for site in self._registry.all()}
        database = await self._database()
        predictors = self._predictors.status()
        return {
            "ready": database == "ok" and any(sites.values()),
            "database": database,
            "sites": sites,
            # Sites an operator is draining (they finish their work and take nothing new).
            "draining": self._drainer.draining(),
            # Requests whose rows the database has not taken yet (written behind the answers):
            # growing, with an old oldest, means the database is refusing writes.
            "request_log": {
                "queued": len(self._request_log),
                "oldest_s": round(self._request_log.oldest_s(), 3),
            },
            "predictor": self._prediction(),
            # Served models with a predictor of their own (the default predicts the others).
            "model_predictors": {
                model: status.version
                for model, status in predictors.items()
                if model != DEFAULT_MODEL
            },
        }

    def _prediction(self) -> dict[str, object]:
        """Whether the served models are predicted: `mode` active (all of them, by their own
        predictor or the default), partial or fallback (none); `models` the version predicting
        each; `version` the default's (None: no default, which is no harm while every served
        model has its own)."""
        serving = {model: self._predictors.version(model) for model in self._served_models}
        predicted = sum(version is not None for version in serving.values())
        mode = "active" if predicted == len(serving) else "partial" if predicted else "fallback"
        return {
            "mode": mode,
            "version": self._predictors.status()[DEFAULT_MODEL].version,
            "models": serving,
        }
