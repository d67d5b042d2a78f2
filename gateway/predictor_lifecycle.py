"""Which length predictor the gateway serves, from start-up to every newly activated version.

At start: the version the database marks active, else GATEWAY_PREDICTOR_DIR (registered and
activated), else none (fallback mode). A configured artifact that cannot be loaded stops the
start with a clear message: serving silently without it would hide a broken deployment. Later,
a version activated in the registry (by the retrain command, or an operator) is loaded without a
restart; if it cannot be loaded, the current one keeps serving and the error is logged.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from gateway.prediction import PredictorLike, PredictorService
from gateway.services.predictor_registry import PredictorRegistry
from gateway.settings import GatewaySettings

log = logging.getLogger(__name__)


class PredictorStartupError(RuntimeError):
    """The configured predictor artifact is missing or unusable."""


def load_predictor(path: Path) -> PredictorLike:
    # Imported here: onnxruntime and the artifact code load only when a predictor is configured.
    from predictor.runtime import LengthPredictor

    predictor: PredictorLike = LengthPredictor.load(path, threads=1)
    return predictor


def artifact_summary(path: Path) -> tuple[str, str, dict[str, object]]:
    """(kind, scheme name, metrics) from an artifact's manifest, for the registry."""
    from predictor.artifact import load_manifest

    manifest = load_manifest(path)
    return str(manifest.kind), manifest.scheme.name, dict(manifest.metrics)


async def start_predictor(
    settings: GatewaySettings, registry: PredictorRegistry
) -> PredictorService:
    active = await registry.active()
    path = Path(active.path) if active is not None else settings.predictor_dir
    if path is None:
        log.warning("no length predictor configured: fallback mode (engines plan with max_tokens)")
        return PredictorService(None, loader=load_predictor)
    try:
        predictor = await asyncio.to_thread(load_predictor, path)
    except Exception as exc:
        source = "the active registered version" if active else "GATEWAY_PREDICTOR_DIR"
        raise PredictorStartupError(
            f"cannot load the length predictor at {path} ({source}): {exc}"
        ) from exc
    if active is None:
        kind, scheme, metrics = artifact_summary(path)
        await registry.register(version=predictor.version, path=str(path.resolve()), kind=kind,
                                scheme=scheme, metrics=metrics, activate=True)  # fmt: skip
    log.info("length predictor %s loaded from %s", predictor.version, path)
    return PredictorService(predictor, path=str(path), loader=load_predictor)


async def follow_registry(
    service: PredictorService, registry: PredictorRegistry, poll_s: float
) -> None:
    """Swaps to whichever version the registry marks active, whenever that changes."""
    while True:
        await asyncio.sleep(poll_s)
        try:
            active = await registry.active()
            if active is not None and active.version != service.version:
                await service.swap(Path(active.path))
        except Exception:  # keep serving the current version; the next poll tries again
            log.exception("could not switch the length predictor")
