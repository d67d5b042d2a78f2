"""Which length predictors the gateway serves, from start-up to every newly activated version.

For each served model and for the default (every model without its own), at start: the version
the database marks active for it, else the configured artifact (the federation file's
`predictor` for a model, GATEWAY_PREDICTOR_DIR for the default; registered and activated), else
none (the default's fallback mode: engines plan with max_tokens). A configured artifact that
cannot be loaded stops the start with a clear message: serving silently without it would hide a
broken deployment. Later,
a version activated in the registry (by the retrain command, or an operator) is loaded without a
restart; if it cannot be loaded, the current one keeps serving and the error is logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path

from gateway.federation import ModelConfig
from gateway.prediction.by_model import ModelPredictors
from gateway.prediction.service import PredictorLike, PredictorService
from gateway.settings import GatewaySettings
from gateway.stores.predictor_registry import (
    DEFAULT_MODEL,
    PredictorRegistry,
    RegisteredVersion,
)

log = logging.getLogger(__name__)


class PredictorStartupError(RuntimeError):
    """The configured predictor artifact is missing or unusable."""


def load_predictor(path: Path) -> PredictorLike:
    # Imported here: onnxruntime and the artifact code load only when a predictor is configured.
    from predictor.runtime import LengthPredictor

    predictor: PredictorLike = LengthPredictor.load(path, threads=1)
    return predictor


async def register_artifact(
    registry: PredictorRegistry,
    path: Path,
    *,
    model: str,
    activate: bool,
    decision: dict[str, object] | None = None,
) -> RegisteredVersion:
    """Registers the artifact at `path` (kind, scheme and metrics from its manifest; with the
    activation decision's numbers when one was made)."""
    from predictor.artifact import load_manifest

    manifest = await asyncio.to_thread(load_manifest, path)
    resolved = await asyncio.to_thread(path.resolve)
    metrics = dict(manifest.metrics) | ({"activation": decision} if decision else {})
    return await registry.register(
        version=manifest.version,
        path=str(resolved),
        kind=str(manifest.kind),
        scheme=manifest.scheme.name,
        metrics=metrics,
        activate=activate,
        model=model,
    )


async def start_predictors(
    settings: GatewaySettings, models: Iterable[ModelConfig], registry: PredictorRegistry
) -> ModelPredictors:
    """The default predictor and each served model's own, as the registry or the configuration
    names them."""
    active = await registry.active_by_model()
    served = [model.name for model in models]
    configured: dict[str, Path | None] = {DEFAULT_MODEL: settings.predictor.default_dir}
    configured |= {model.name: model.predictor for model in models}
    services: dict[str, PredictorService] = {}
    for model, path in configured.items():
        service = await _start_one(model, active.get(model), path, registry)
        if service is not None:
            services[model] = service
    default = services.pop(DEFAULT_MODEL, None) or PredictorService(None, loader=load_predictor)
    unpredicted = [name for name in served if name not in services]
    if default.version is None and unpredicted:
        log.warning(
            "no length predictor for %s (neither its own nor a default): its requests go "
            "without predictions",
            ", ".join(unpredicted),
        )
    return ModelPredictors(default, services, loader=load_predictor)


async def _start_one(
    model: str,
    active: RegisteredVersion | None,
    configured: Path | None,
    registry: PredictorRegistry,
) -> PredictorService | None:
    path = Path(active.path) if active is not None else configured
    if path is None:
        return None
    try:
        predictor = await asyncio.to_thread(load_predictor, path)
    except Exception as exc:
        source = "the active registered version" if active else "the configured artifact"
        raise PredictorStartupError(
            f"cannot load the length predictor of {_label(model)} at {path} ({source}): {exc}"
        ) from exc
    if active is None:
        await register_artifact(registry, path, model=model, activate=True)
    log.info("length predictor %s loaded from %s for %s", predictor.version, path, _label(model))
    return PredictorService(predictor, path=str(path), loader=load_predictor)


def _label(model: str) -> str:
    return f"model {model}" if model != DEFAULT_MODEL else "the default"


async def follow_registry(
    predictors: ModelPredictors,
    registry: PredictorRegistry,
    served_models: Iterable[str],
    poll_s: float,
) -> None:
    """Swaps each model to whichever version the registry marks active, whenever that changes."""
    watched = {DEFAULT_MODEL, *served_models}
    while True:
        await asyncio.sleep(poll_s)
        try:
            active = await registry.active_by_model()
        except Exception:  # keep serving the current versions; the next poll tries again
            log.exception("could not read the predictor registry")
            continue
        for model, version in active.items():
            current = predictors.status().get(model)
            if model not in watched or (current is not None and current.version == version.version):
                continue
            try:
                await predictors.swap(model, Path(version.path))
            except Exception:  # this model keeps its current version; the next poll tries again
                log.exception("could not switch the length predictor of %s", _label(model))
