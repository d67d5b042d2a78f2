"""Stage 2, predict: the answer's length, as the length predictor of the request's model expects
it, applied to the prepared request (routing plans with it, admission charges by it). Without a
predictor the request goes on unpredicted: routing then plans by the settings' fallback
(GATEWAY_PLAN_WITHOUT_PREDICTION)."""

from __future__ import annotations

from dataclasses import replace

from gateway.dispatch.request import PreparedCompletion
from gateway.prediction.by_model import ModelPredictors
from gateway.prediction.service import Prediction


def with_predicted_length(
    prepared: PreparedCompletion, tokens: int, bucket: int | None
) -> PreparedCompletion:
    """The request planned with an answer of `tokens` tokens (in the predictor's `bucket`)."""
    return replace(
        prepared,
        params=replace(prepared.params, predicted_tokens=tokens),
        predicted_bucket=bucket,
    )


class LengthPrediction:
    """Owns the gateway's length predictors (one per served model, swapped when a new version is
    activated)."""

    def __init__(self, predictors: ModelPredictors) -> None:
        self.predictors = predictors

    async def apply(
        self, prepared: PreparedCompletion, *, alone: bool
    ) -> tuple[PreparedCompletion, Prediction | None]:
        """The request with its predicted answer length (within its max_tokens), and the
        prediction (None: no predictor for the model). `alone`: no other request is in flight,
        so the prompt may be predicted on the event loop (nobody waits)."""
        prediction = await self.predictors.predict(
            prepared.model, prepared.prompt_text, alone=alone
        )
        if prediction is None:
            return prepared, None
        tokens = prediction.within(prepared.params.max_tokens)
        return with_predicted_length(prepared, tokens, prediction.bucket), prediction
