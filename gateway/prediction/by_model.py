"""One length predictor per served model, and the default for models without their own.

A served model's answer lengths are its own (a chat model trained to be thorough answers 4x longer
than one trained to be brief, on the same prompts), so each model is predicted by the version
trained on its answers when there is one. The default ("" in the registry) predicts the others;
without any, requests go on without a prediction.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from pathlib import Path

from gateway.metrics import GatewayMetrics
from gateway.prediction.service import Prediction, PredictorLike, PredictorService, PredictorStatus
from gateway.stores.predictor_registry import DEFAULT_MODEL


class ModelPredictors:
    def __init__(
        self,
        default: PredictorService,
        by_model: dict[str, PredictorService] | None = None,
        *,
        loader: Callable[[Path], PredictorLike] | None = None,
    ) -> None:
        self._services: dict[str, PredictorService] = {DEFAULT_MODEL: default, **(by_model or {})}
        self._loader = loader
        self._started = False

    @property
    def metrics(self) -> GatewayMetrics:
        return self._services[DEFAULT_MODEL].metrics

    @metrics.setter
    def metrics(self, metrics: GatewayMetrics) -> None:
        for service in self._services.values():
            service.metrics = metrics

    def for_model(self, model: str) -> PredictorService:
        """The model's own predictor if it has one that serves, else the default."""
        own = self._services.get(model)
        if own is not None and own.version is not None:
            return own
        return self._services[DEFAULT_MODEL]

    def version(self, model: str) -> str | None:
        return self.for_model(model).version

    async def predict(self, model: str, prompt: str, *, alone: bool = False) -> Prediction | None:
        return await self.for_model(model).predict(prompt, alone=alone)

    def models(self) -> Iterable[str]:
        """The registry keys with a service here ("" for the default)."""
        return self._services.keys()

    def start(self) -> None:
        for service in self._services.values():
            service.start()
        self._started = True

    async def stop(self) -> None:
        await asyncio.gather(*(service.stop() for service in self._services.values()))

    async def swap(self, model: str, path: Path) -> str:
        """Serves the artifact at `path` for `model` (a new service if it had none); raises, and
        changes nothing, if it cannot be loaded."""
        service = self._services.get(model)
        if service is not None:
            return await service.swap(path)
        fresh = PredictorService(None, loader=self._loader, metrics=self.metrics)
        version = await fresh.swap(path)
        if self._started:
            fresh.start()
        self._services[model] = fresh
        return version

    def status(self) -> dict[str, PredictorStatus]:
        return {model: service.status() for model, service in self._services.items()}
