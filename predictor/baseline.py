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
from typing import Any

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
# 4: sparse: n-gram keys through a LabelEncoder instead of the dense TfIdfVectorizer.
ONNX_EXPORT_REVISION = 4


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

    Sparse from end to end: each prompt position gives its unigram and its bigram with the next
    id as one int64 key each, a LabelEncoder (a hash table) turns the keys into feature indexes
    (the vectorizer's vocabulary; unknown n-grams and padding go to an extra feature whose IDF
    and weights are zero), and the class scores are the sum over the prompt's n-grams of
    IDF x weights gathered by feature: x . W = sum_f count_f idf_f W_f. The L2 norm of the
    TF-IDF row divides those few scores (x/|x| . W = (x . W)/|x|); |x|^2 = sum_f (count_f
    idf_f)^2 is summed over positions, each weighted by how many positions share its feature
    (an equality test among the row's at most 2 x max_tokens n-grams). An all-zero row keeps
    scores 0, so its probabilities are the softmax of the intercepts, as in scikit-learn.

    Revision 3 ran onnxruntime's TfIdfVectorizer instead: its dense (N, 50,000) output alone cost
    ~65 us a chat prompt on the gateway's core, most of a prediction."""
    from onnx import TensorProto, helper

    vectorizer: TfidfVectorizer = pipeline.named_steps["tfidf"]
    classifier: LogisticRegression = pipeline.named_steps["logreg"]
    keys, features = _ngram_keys(vectorizer.vocabulary_)
    # The extra feature of unknown n-grams and padding: zero IDF, zero weights.
    nodes = _sparse_nodes(keys, features, unknown=len(vectorizer.idf_))
    constants = _sparse_constants(vectorizer, classifier)
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
    opsets = [helper.make_opsetid("", ONNX_OPSET), helper.make_opsetid("ai.onnx.ml", 2)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = ONNX_IR_VERSION
    path.write_bytes(model.SerializeToString())


def _sparse_constants(vectorizer: TfidfVectorizer, classifier: LogisticRegression) -> list[Any]:
    """The graph's initializers: IDF and IDF x weights by feature (the unknown feature last, all
    zero), the intercepts, the classes and the small constants the nodes index with."""
    from onnx import numpy_helper

    idf = np.append(np.asarray(vectorizer.idf_, dtype=np.float32), np.float32(0.0))
    coefficients = np.asarray(classifier.coef_, dtype=np.float32)
    intercepts = np.asarray(classifier.intercept_, dtype=np.float32)
    if coefficients.shape[0] == 1:  # two classes: scikit-learn scores the second only
        coefficients = np.vstack([np.zeros_like(coefficients), coefficients])
        intercepts = np.concatenate([np.zeros_like(intercepts), intercepts])
    weighted = np.vstack([coefficients.T, np.zeros((1, coefficients.shape[0]), np.float32)])
    weighted *= idf[:, None]
    values = {
        "idf": idf,
        "weighted": weighted,
        "intercepts": intercepts,
        "tiny": np.array([np.finfo(np.float32).tiny], np.float32),
        "classes": np.asarray(classifier.classes_, dtype=np.int64),
        "zero": np.array(0, np.int64),
        "one": np.array(1, np.int64),
        "none": np.array(-1, np.int64),
        "id_limit": np.array(_ID_LIMIT, np.int64),
        "axis1": np.array([1], np.int64),
        "axis2": np.array([2], np.int64),
        "first": np.array([0], np.int64),
        "second": np.array([1], np.int64),
        "last": np.array([-1], np.int64),
        "end": np.array([np.iinfo(np.int64).max], np.int64),
    }
    return [numpy_helper.from_array(np.ascontiguousarray(v), k) for k, v in values.items()]


def _sparse_nodes(keys: list[int], features: list[int], unknown: int) -> list[Any]:
    """token_ids -> n-gram keys -> features -> scores and norm -> probabilities and label."""
    from onnx import TensorProto, helper

    node = helper.make_node
    return [
        # Ids outside [0, 2^20) (padding, or none the vocabulary can hold) key nothing.
        node("GreaterOrEqual", [TOKEN_IDS_INPUT, "zero"], ["nonnegative"]),
        node("Less", [TOKEN_IDS_INPUT, "id_limit"], ["small"]),
        node("And", ["nonnegative", "small"], ["valid"]),
        node("Where", ["valid", TOKEN_IDS_INPUT, "none"], ["unigrams"]),
        node("Slice", ["unigrams", "first", "last", "second"], ["left"]),
        node("Slice", ["unigrams", "second", "end", "second"], ["right"]),
        node("Add", ["left", "one"], ["left_plus"]),
        node("Mul", ["left_plus", "id_limit"], ["shifted"]),
        node("Add", ["shifted", "right"], ["pair_keys"]),
        node("Min", ["left", "right"], ["pair_min"]),
        node("Less", ["pair_min", "zero"], ["pair_invalid"]),
        node("Where", ["pair_invalid", "none", "pair_keys"], ["bigrams"]),
        node("Concat", ["unigrams", "bigrams"], ["keys"], axis=1),
        node("LabelEncoder", ["keys"], ["features"], domain="ai.onnx.ml",
             keys_int64s=keys, values_int64s=features, default_int64=unknown),
        # Scores: sum over the row's n-grams of idf x weights.
        node("Gather", ["weighted", "features"], ["rows"], axis=0),
        node("ReduceSum", ["rows", "axis1"], ["scores"], keepdims=0),
        # |x|^2: each position's idf^2 times the count of positions sharing its feature.
        node("Unsqueeze", ["features", "axis2"], ["column"]),
        node("Unsqueeze", ["features", "axis1"], ["row"]),
        node("Equal", ["column", "row"], ["same"]),
        node("Cast", ["same"], ["same_f"], to=TensorProto.FLOAT),
        node("ReduceSum", ["same_f", "axis2"], ["counts"], keepdims=0),
        node("Gather", ["idf", "features"], ["idfs"], axis=0),
        node("Mul", ["idfs", "idfs"], ["idf_sq"]),
        node("Mul", ["idf_sq", "counts"], ["squares"]),
        node("ReduceSum", ["squares", "axis1"], ["norm_sq"], keepdims=1),
        node("Sqrt", ["norm_sq"], ["norm"]),
        node("Max", ["norm", "tiny"], ["divisor"]),
        node("Div", ["scores", "divisor"], ["scaled"]),
        node("Add", ["scaled", "intercepts"], ["logits"]),
        node("Softmax", ["logits"], ["probabilities"], axis=1),
        node("ArgMax", ["logits"], ["best"], axis=1, keepdims=0),
        node("Gather", ["classes", "best"], ["label"]),
    ]  # fmt: skip


# Wordpiece ids are below this (BERT's vocabulary has 30,522); a bigram's key is
# (left + 1) x 2^20 + right, above every unigram's.
_ID_LIMIT = 1 << 20


def _ngram_keys(vocabulary: dict[str, int]) -> tuple[list[int], list[int]]:
    """The vocabulary ("101 2023": a bigram of wordpiece ids) as LabelEncoder keys (a unigram's
    id, a bigram's (left + 1) x 2^20 + right) and their feature indexes."""
    keys: list[int] = []
    features: list[int] = []
    for ngram, index in sorted(vocabulary.items(), key=lambda item: item[1]):
        ids = [int(token) for token in ngram.split(" ")]
        if len(ids) > 2 or not all(0 <= i < _ID_LIMIT for i in ids):
            raise ValueError(f"the export keys unigrams and bigrams of ids < 2^20, not {ngram!r}")
        keys.append(ids[0] if len(ids) == 1 else (ids[0] + 1) * _ID_LIMIT + ids[1])
        features.append(index)
    return keys, features
