"""The strongest simple rival of a length predictor on served samples: TF-IDF + ridge regression.

Fitted in a second or two on the same served samples a candidate learned from, it predicts the
mean length directly; a predictor that cannot beat it has not earned its encoder. Its p90 is the
prediction scaled by the training residuals' 90th percentile ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import Ridge
from sklearn.pipeline import Pipeline, make_pipeline


@dataclass(frozen=True, slots=True)
class TfidfLength:
    pipeline: Pipeline
    p90_ratio: float

    def predict(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(expected tokens, p90 tokens) per prompt."""
        expected = np.maximum(np.asarray(self.pipeline.predict(list(prompts))), 1.0)
        return expected, np.ceil(expected * self.p90_ratio)


def fit_tfidf_length(prompts: Sequence[str], lengths: Sequence[int]) -> TfidfLength:
    if len(prompts) != len(lengths) or len(prompts) < 2:
        raise ValueError("TF-IDF needs at least 2 (prompt, length) pairs of equal count")
    pipeline = make_pipeline(
        TfidfVectorizer(ngram_range=(1, 2), min_df=1, sublinear_tf=True, max_features=50_000),
        Ridge(alpha=1.0),
    )
    pipeline.fit(list(prompts), np.asarray(lengths, dtype=np.float64))
    fitted = np.maximum(np.asarray(pipeline.predict(list(prompts))), 1.0)
    ratios = np.asarray(lengths, dtype=np.float64) / fitted
    return TfidfLength(pipeline, max(1.0, float(np.percentile(ratios, 90))))
