"""The simple rankers a trained ranking head must beat: linear models over TF-IDF of the prompt.

- `tfidf_ridge`: ridge regression of log(answer tokens) on TF-IDF word 1-2 grams and the
  prompt's log length (pointwise: order by the predicted log length);
- `tfidf_pairwise`: RankSVM-style pairwise logistic regression on the same features: random
  pairs of training prompts whose lengths differ by more than a tie width, the difference of
  their feature rows labelled by which answer was longer; the score is the learned w . x.

Seconds to fit on two cores. Regularization is scikit-learn's default (nothing is tuned on the
validation split). Their scores are not lengths: only the rank metrics apply to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp  # type: ignore[import-untyped]
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression, Ridge

PAIRS_PER_PROMPT = 8
TIE_TOKENS = 10


@dataclass(frozen=True, slots=True)
class LinearRanker:
    vectorizer: TfidfVectorizer
    weights: np.ndarray  # over the TF-IDF columns and the log length
    intercept: float

    def scores(self, prompts: Sequence[str]) -> np.ndarray:
        x = _features(self.vectorizer, prompts)
        return np.asarray(x @ self.weights, dtype=np.float64) + self.intercept


def _features(vectorizer: TfidfVectorizer, prompts: Sequence[str]) -> sp.csr_matrix:
    chars = np.log1p(np.array([len(p) for p in prompts], dtype=np.float64))[:, None] / 8.0
    return sp.hstack([vectorizer.transform(list(prompts)), sp.csr_matrix(chars)]).tocsr()


def _vectorizer(prompts: Sequence[str]) -> TfidfVectorizer:
    vectorizer = TfidfVectorizer(
        ngram_range=(1, 2), min_df=2, sublinear_tf=True, max_features=50_000
    )
    vectorizer.fit(list(prompts))
    return vectorizer


def fit_ridge(prompts: Sequence[str], lengths: Sequence[int]) -> LinearRanker:
    vectorizer = _vectorizer(prompts)
    target = np.log(np.maximum(np.asarray(lengths, dtype=np.float64), 1.0))
    model = Ridge(alpha=1.0).fit(_features(vectorizer, prompts), target)
    return LinearRanker(vectorizer, np.asarray(model.coef_).ravel(), float(model.intercept_))


def fit_pairwise(prompts: Sequence[str], lengths: Sequence[int], seed: int = 0) -> LinearRanker:
    vectorizer = _vectorizer(prompts)
    x = _features(vectorizer, prompts)
    groups = np.asarray(lengths, dtype=np.int64) // TIE_TOKENS
    rng = np.random.default_rng(seed)
    n = len(prompts)
    first = rng.integers(0, n, n * PAIRS_PER_PROMPT)
    second = rng.integers(0, n, n * PAIRS_PER_PROMPT)
    kept = groups[first] != groups[second]
    first, second = first[kept], second[kept]
    labels = (groups[first] > groups[second]).astype(np.int64)
    model = LogisticRegression(fit_intercept=False, max_iter=1000)
    model.fit(x[first] - x[second], labels)
    return LinearRanker(vectorizer, np.asarray(model.coef_).ravel(), 0.0)
