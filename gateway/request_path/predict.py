"""Stage 2, predict: the answer's length, as the length predictor of the request's model expects
it, applied to the prepared request (routing plans with it, admission charges by it); a LoRA
adapter's request is predicted by its base's predictor, corrected by what the adapter's served
answers taught (gateway/prediction/adapter_lengths.py). Without a predictor the request goes on
unpredicted: routing then plans by the settings' fallback (GATEWAY_PLAN_WITHOUT_PREDICTION)."""

from __future__ import annotations

from dataclasses import replace

from gateway.dispatch.request import PreparedCompletion
from gateway.prediction.adapter_lengths import AdapterLengths
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

    def __init__(self, predictors: ModelPredictors, adapters: AdapterLengths | None = None) -> None:
        self.predictors = predictors
        self.adapters = adapters or AdapterLengths()

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
        max_tokens = prepared.params.max_tokens
        base_tokens = prediction.within(max_tokens)
        adapter = prepared.params.options.adapter
        if adapter:
            prediction = self.adapters.corrected(adapter, prediction)
        tokens = prediction.within(max_tokens)
        planned = with_predicted_length(prepared, tokens, prediction.bucket)
        return replace(planned, base_predicted_tokens=base_tokens), prediction

    def served(
        self, prepared: PreparedCompletion, completion_tokens: int, finish_reason: str | None
    ) -> None:
        """A request ended (dispatch's LengthFeedback): an adapter's answer with one choice that
        ended on its own teaches the adapter's correction (a cut one only bounds its length)."""
        adapter = prepared.params.options.adapter
        base = prepared.base_predicted_tokens
        if adapter and base and finish_reason == "stop" and prepared.params.options.n == 1:
            self.adapters.observe(adapter, base, completion_tokens)
