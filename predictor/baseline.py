"""The fast baseline: TF-IDF over wordpiece 1-2 grams + multinomial logistic regression.

It reads the prompt as its wordpiece ids (the same tokenizer and truncation as the MiniLM
model): scikit-learn trains on them written as digits separated by spaces, and the ONNX graph
counts the same n-grams of the ids as int64 (export_sklearn_onnx), so it matches `predict_proba`
without reproducing scikit-learn's regular expressions on raw text. Sublinear TF is left off
(the ONNX vectorizer has no such mode).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline

from predictor.encoding import DEFAULT_MAX_TOKENS, TOKEN_IDS_INPUT

ONNX_OPSET = 17
# The IR version of opset 17 (onnx 1.12): what every onnxruntime this project pins can load.
ONNX_IR_VERSION = 8
# 2: the TF-IDF rows are L2-normalized by LpNormalization, not the ML Normalizer.
# 3: the graph is built from the pipeline (export_sklearn_onnx), reading the ids as int64.
ONNX_EXPORT_REVISION = 3


@dataclass(frozen=True, slots=True)
class SklearnConfig:
    ngram_max: int = 2
    min_df: int = 2
    max_features: int = 50_000
    inverse_regularization: float = 4.0
    max_iter: int = 300
    max_tokens: int = DEFAULT_MAX_TOKENS

    def to_json(self) -> dict[str, object]:
        # The export's revision is part of what an artifact was built with: a build finding an
        # artifact of an older export trains a new one instead of reusing it.
        return {**asdict(self), "onnx_export": ONNX_EXPORT_REVISION}


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
    """ONNX graph: token_ids (N, W) int64 -> label (N,), probabilities (N, classes).

    Built from the fitted pipeline rather than by skl2onnx, whose graph was slow at serving
    (55 us a short prompt for 50,000 features, the gateway's largest cost of a prediction): it
    split one string per prompt with a string tokenizer and ran three dense (N, features)
    passes after the vectorizer (IDF product, L2 normalization, an element-by-element linear
    classifier). Here the vectorizer counts the id n-grams and weighs them by IDF itself, one
    matrix product gives the class scores, and the L2 norm divides those few scores: the
    normalization is a scalar per row, so x/|x| . W = (x . W)/|x|. An all-zero row (no known
    n-gram) keeps scores 0, so its probabilities are the softmax of the intercepts, as in
    scikit-learn."""
    from onnx import TensorProto, helper, numpy_helper

    vectorizer: TfidfVectorizer = pipeline.named_steps["tfidf"]
    classifier: LogisticRegression = pipeline.named_steps["logreg"]
    pool, starts, indexes = _ngram_pool(vectorizer.vocabulary_)
    idf = np.asarray(vectorizer.idf_, dtype=np.float32)
    coefficients = np.asarray(classifier.coef_, dtype=np.float32)
    intercepts = np.asarray(classifier.intercept_, dtype=np.float32)
    if coefficients.shape[0] == 1:  # two classes: scikit-learn scores the second only
        coefficients = np.vstack([np.zeros_like(coefficients), coefficients])
        intercepts = np.concatenate([np.zeros_like(intercepts), intercepts])
    constants = [
        numpy_helper.from_array(np.ascontiguousarray(coefficients.T), "coefficients"),
        numpy_helper.from_array(intercepts, "intercepts"),
        numpy_helper.from_array(np.array([np.finfo(np.float32).tiny], np.float32), "tiny"),
        numpy_helper.from_array(np.asarray(classifier.classes_, dtype=np.int64), "classes"),
    ]
    nodes = [
        helper.make_node(
            "TfIdfVectorizer", [TOKEN_IDS_INPUT], ["tfidf"], mode="TFIDF",
            min_gram_length=1, max_gram_length=len(starts), max_skip_count=0,
            ngram_counts=starts, ngram_indexes=indexes,
            pool_int64s=pool, weights=idf[indexes].tolist(),  # in pool order, not feature
        ),
        helper.make_node("MatMul", ["tfidf", "coefficients"], ["scores"]),
        helper.make_node("ReduceL2", ["tfidf"], ["norm"], axes=[1], keepdims=1),
        helper.make_node("Max", ["norm", "tiny"], ["divisor"]),
        helper.make_node("Div", ["scores", "divisor"], ["scaled"]),
        helper.make_node("Add", ["scaled", "intercepts"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
        helper.make_node("ArgMax", ["logits"], ["best"], axis=1, keepdims=0),
        helper.make_node("Gather", ["classes", "best"], ["label"]),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "tfidf_logreg",
        [helper.make_tensor_value_info(TOKEN_IDS_INPUT, TensorProto.INT64, [None, None])],
        [
            helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
            helper.make_tensor_value_info(
                "probabilities", TensorProto.FLOAT, [None, len(classifier.classes_)]
            ),
        ],
        constants,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])
    model.ir_version = ONNX_IR_VERSION
    path.write_bytes(model.SerializeToString())


def _ngram_pool(vocabulary: dict[str, int]) -> tuple[list[int], list[int], list[int]]:
    """The vocabulary ("101 2023": a bigram of wordpiece ids) as TfIdfVectorizer attributes:
    the pool of ids (n-grams grouped by length, shortest first, each as its n ids), where each
    length n = 1, 2, ... starts in the pool, and each n-gram's feature index in pool order."""
    by_length: dict[int, list[tuple[list[int], int]]] = {}
    for ngram, index in vocabulary.items():
        ids = [int(token) for token in ngram.split(" ")]
        by_length.setdefault(len(ids), []).append((ids, index))
    pool: list[int] = []
    starts: list[int] = []
    indexes: list[int] = []
    for length in range(1, max(by_length) + 1):
        starts.append(len(pool))
        for ids, index in sorted(by_length.get(length, [])):
            pool += ids
            indexes.append(index)
    return pool, starts, indexes
