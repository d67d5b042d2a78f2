"""The fast baseline: TF-IDF over wordpiece 1-2 grams + multinomial logistic regression.

It reads the prompt as its wordpiece ids (the same tokenizer and truncation as the MiniLM
model), written as digits separated by spaces: the ONNX export then tokenizes exactly as
scikit-learn does, which it cannot promise for scikit-learn's regular expressions on raw text.
Sublinear TF is left off for the same reason (skl2onnx does not reproduce it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline

from predictor.encoding import DEFAULT_MAX_TOKENS

ONNX_OPSET = 17


@dataclass(frozen=True, slots=True)
class SklearnConfig:
    ngram_max: int = 2
    min_df: int = 2
    max_features: int = 50_000
    inverse_regularization: float = 4.0
    max_iter: int = 300
    max_tokens: int = DEFAULT_MAX_TOKENS

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def train_sklearn(id_strings: Sequence[str], labels: np.ndarray, config: SklearnConfig) -> Pipeline:
    """Fits the pipeline on prompts given as wordpiece id strings (PromptEncoder.id_strings)."""
    if len(set(np.asarray(labels).tolist())) < 2:
        raise ValueError("the training lengths all fall in one bucket: nothing to learn")
    vectorizer = TfidfVectorizer(
        lowercase=False,  # the uncased wordpiece tokenizer already lowercased
        token_pattern=r"\S+",
        ngram_range=(1, config.ngram_max),
        min_df=min(config.min_df, max(1, len(id_strings) // 10)),
        max_features=config.max_features,
        dtype=np.float32,
    )
    classifier = LogisticRegression(C=config.inverse_regularization, max_iter=config.max_iter)
    pipeline = Pipeline([("tfidf", vectorizer), ("logreg", classifier)])
    pipeline.fit(list(id_strings), np.asarray(labels))
    return pipeline


def output_buckets(pipeline: Pipeline) -> tuple[int, ...]:
    """The bucket of each probability column (buckets never seen in training have none)."""
    return tuple(int(c) for c in pipeline.named_steps["logreg"].classes_)


def export_sklearn_onnx(pipeline: Pipeline, path: Path) -> None:
    """ONNX graph: text (N, 1) string -> label (N,), probabilities (N, classes)."""
    from skl2onnx import to_onnx  # type: ignore[import-untyped]
    from skl2onnx.common.data_types import StringTensorType  # type: ignore[import-untyped]

    classifier = pipeline.named_steps["logreg"]
    model = to_onnx(
        pipeline,
        initial_types=[("text", StringTensorType([None, 1]))],
        # Split on spaces only (the ids never contain any), and a plain probability matrix.
        options={
            id(pipeline.named_steps["tfidf"]): {"separators": [" "]},
            id(classifier): {"zipmap": False},
        },
        target_opset=ONNX_OPSET,
    )
    path.write_bytes(model.SerializeToString())
