"""Settings of the predictor's drift signal and of the retrain jobs it can start.

Kept apart from gateway/settings.py (which holds every other group and nests these two) so that
neither file grows past what one reads in a sitting; both are read by the same field-driven
reader (fedllm_contract/env_settings.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from fedllm_contract.env_settings import SettingsError, require_at_least, setting

RETRAIN_MODES = ("calibrate", "retrain")


@dataclass(frozen=True, slots=True)
class DriftSettings:
    """The predictor's rolling error on served traffic, per model (docs/predictor-drift.md)."""

    ENV_PREFIX: ClassVar[str] = "GATEWAY_DRIFT_"

    window_samples: int = setting(
        500,
        help="the rolling error is computed over each model's last this many finished requests "
        "predicted by the version serving it now",
    )
    window_s: float = setting(
        7 * 86400.0,
        help="... and only over requests of this many seconds back at most (0: no time bound)",
    )
    min_samples: int = setting(
        100, help="a model with fewer samples in its window is never flagged as drifted"
    )
    max_mae_ratio: float = setting(
        1.0,
        help="drifted when the MAE of expected tokens reaches this multiple of the MAE of "
        "predicting the window's served mean",
    )
    min_spearman: float = setting(
        0.1,
        help="... or when the rank correlation of predicted and true lengths falls below this",
    )
    include_censored: bool = setting(
        False,
        help="count answers cut at max_tokens (their length is a lower bound) in the window",
    )
    refresh_s: float = setting(
        60.0,
        help="how often the rolling error is recomputed (off the request path; `/metrics` and "
        "the dashboard show the last result)",
    )

    def __post_init__(self) -> None:
        require_at_least(self, 1, "window_samples", "min_samples")
        if self.window_s < 0 or self.refresh_s <= 0 or self.max_mae_ratio <= 0:
            raise SettingsError(
                "GATEWAY_DRIFT_WINDOW_S >= 0, GATEWAY_DRIFT_REFRESH_S > 0, "
                "GATEWAY_DRIFT_MAX_MAE_RATIO > 0"
            )
        if self.min_samples > self.window_samples:
            raise SettingsError("GATEWAY_DRIFT_MIN_SAMPLES must be <= GATEWAY_DRIFT_WINDOW_SAMPLES")
        if not -1.0 <= self.min_spearman <= 1.0:
            raise SettingsError("GATEWAY_DRIFT_MIN_SPEARMAN must be between -1 and 1")


@dataclass(frozen=True, slots=True)
class RetrainSettings:
    """Retrain jobs: queued by an operator (admin API) or by drift, run off the event loop."""

    ENV_PREFIX: ClassVar[str] = "GATEWAY_RETRAIN_"

    on_drift: bool = setting(
        False,
        help="queue a retrain job for a model when its predictor drifts (at most one open job "
        "per model, none within GATEWAY_RETRAIN_COOLDOWN_S of the last)",
    )
    worker: bool = setting(
        True,
        help="this gateway runs queued retrain jobs, each in a subprocess (`python -m "
        "gateway.retrain_predictor --job ID`) when torch and scikit-learn are installed (the "
        "gateway image has neither: jobs then wait for `--run-queued` on the trainer image)",
    )
    mode: str = setting(
        "calibrate",
        help="what a job does unless its request says: `calibrate` (seconds) or `retrain` "
        "(minutes, needs torch)",
    )
    min_samples: int = setting(50, help="a job with fewer usable samples fails")
    max_samples: int = setting(
        0,
        help="a job learns from the model's newest this many samples only (0: every sample; "
        "after a mix shift the old mix would outvote the new)",
    )
    include_censored: bool = setting(False, help="jobs also learn from answers cut at max_tokens")
    cooldown_s: float = setting(
        6 * 3600.0, help="no drift-triggered job for a model this soon after its last job"
    )
    job_timeout_s: float = setting(
        3600.0, help="a job running longer is stopped and recorded as failed"
    )
    poll_s: float = setting(5.0, help="how often the worker looks for a queued job")
    out_dir: Path = setting(
        Path("var/predictor"),
        help="where a job writes its candidate artifact (a directory per job, named after its "
        "id and model)",
    )

    def __post_init__(self) -> None:
        if self.mode not in RETRAIN_MODES:
            raise SettingsError(f"GATEWAY_RETRAIN_MODE must be one of {RETRAIN_MODES}")
        require_at_least(self, 1, "min_samples")
        if self.max_samples < 0:
            raise SettingsError("GATEWAY_RETRAIN_MAX_SAMPLES must be >= 0")
        if self.cooldown_s < 0 or self.job_timeout_s <= 0 or self.poll_s <= 0:
            raise SettingsError(
                "GATEWAY_RETRAIN_COOLDOWN_S >= 0, GATEWAY_RETRAIN_JOB_TIMEOUT_S > 0, "
                "GATEWAY_RETRAIN_POLL_S > 0"
            )
