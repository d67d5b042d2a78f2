from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from predictor.artifact import MANIFEST_FILE, MODEL_FILE
from predictor.distribution import expected_tokens, p90_tokens
from predictor.encoding import PromptEncoder
from predictor.runtime import LengthPrediction, LengthPredictor

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module", params=["sklearn", "minilm", "minilm_chars"])
def predictor(request, sklearn_artifact, minilm_artifact, minilm_chars_artifact) -> LengthPredictor:
    path = {
        "sklearn": sklearn_artifact,
        "minilm": minilm_artifact,
        "minilm_chars": minilm_chars_artifact,
    }[request.param]
    return LengthPredictor.load(path, threads=1)


def test_single_prediction_is_consistent(predictor):
    result = predictor.predict("Write a long essay about the sea.")
    assert isinstance(result, LengthPrediction)
    n = predictor.manifest.scheme.n_buckets
    assert len(result.probabilities) == n
    assert sum(result.probabilities) == pytest.approx(1.0, abs=1e-5)
    probs = np.array(result.probabilities)
    # The named bucket: argmax, with the bias the artifact fitted on validation.
    assert result.bucket == int(predictor.manifest.decision.apply(probs[None, :])[0])
    assert result.expected_tokens == pytest.approx(
        float(expected_tokens(probs, predictor.manifest.lengths))
    )
    assert result.p90_tokens == int(p90_tokens(probs, predictor.manifest.lengths))
    assert result.version == predictor.version


def test_batch_matches_single_predictions(predictor):
    prompts = ["Spell the moon.", "Write a detailed story about trains.", "", "x " * 3000]
    batch = predictor.predict_batch(prompts)
    assert len(batch) == len(prompts)
    # Dynamic int8 quantizes activations with one scale per tensor, i.e. per batch: a prompt's
    # probabilities move slightly with its batch-mates. fp32 is exact.
    quantized = predictor.manifest.metrics.get("quantization", {}).get("used", False)
    tolerance = 0.02 if quantized else 1e-5
    for prompt, row in zip(prompts, batch, strict=True):
        single = predictor.predict(prompt)
        assert row.probabilities == pytest.approx(single.probabilities, abs=tolerance)
    assert predictor.predict_batch([]) == []


def test_empty_prompt_is_a_valid_prediction(predictor):
    result = predictor.predict("")
    assert sum(result.probabilities) == pytest.approx(1.0, abs=1e-5)
    assert result.expected_tokens > 0


def test_very_long_prompt_is_truncated_not_refused(predictor):
    long = "Write a long essay about the sea. " * 20_000  # ~700 kB
    truncated = predictor.predict(long)
    # Only the first max_tokens tokens count, so the tail never changes the answer.
    assert truncated.probabilities == pytest.approx(
        predictor.predict(long + " Answer yes or no.").probabilities, abs=1e-6
    )


@pytest.mark.parametrize("bad", [None, 42, b"bytes", ["a list"]])
def test_non_str_prompt_is_a_type_error(predictor, bad):
    with pytest.raises(TypeError, match="must be str"):
        predictor.predict(bad)
    with pytest.raises(TypeError, match="must be str"):
        predictor.predict_batch(["fine", bad])


def test_a_bare_string_is_not_a_batch(predictor):
    with pytest.raises(TypeError, match="list of str"):
        predictor.predict_batch("abc")


def test_threads_must_be_positive(sklearn_artifact):
    with pytest.raises(ValueError, match="threads"):
        LengthPredictor.load(sklearn_artifact, threads=0)


def test_the_tiny_models_learned_the_synthetic_signal(predictor):
    short = predictor.predict("Answer yes or no: rain.").expected_tokens
    long = predictor.predict("Write a long essay about rain.").expected_tokens
    assert long > short


@pytest.mark.parametrize(("artifact", "reads_length"), [("minilm", False), ("minilm_chars", True)])
def test_only_the_length_feature_model_sees_past_the_truncation(request, artifact, reads_length):
    path = request.getfixturevalue(f"{artifact}_artifact")
    predictor = LengthPredictor.load(path, threads=1)
    encoder = PromptEncoder.from_dir(path, predictor.manifest.max_tokens)
    # Both prompts truncate to the same max_tokens wordpieces; only their lengths differ.
    shorter, longer = "Summarize: " + "word " * 100, "Summarize: " + "word " * 2000
    assert np.array_equal(encoder.encode([shorter])[0], encoder.encode([longer])[0])
    probabilities = predictor.probabilities([shorter, longer])
    assert (not np.allclose(probabilities[0], probabilities[1], atol=1e-6)) == reads_length


def test_importing_the_runtime_does_not_import_torch():
    code = (
        "import sys, predictor.runtime; "
        "sys.exit(int('torch' in sys.modules or 'transformers' in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        timeout=60,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr.decode()


def _string_input_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph of a TF-IDF artifact of export revision 2 (skl2onnx's era), rebuilt from a
    current artifact's vocabulary and weights: one string of ids per prompt, split on spaces by
    the com.microsoft Tokenizer, n-grams as strings counted by the dense TfIdfVectorizer."""
    graph = model.graph
    encoder = next(n for n in graph.node if n.op_type == "LabelEncoder")
    attributes = {a.name: helper.get_attribute_value(a) for a in encoder.attribute}
    limit = 1 << 20
    by_length: dict[int, list[tuple[list[str], int]]] = {1: [], 2: []}
    for key, feature in zip(attributes["keys_int64s"], attributes["values_int64s"], strict=True):
        ids = [key] if key < limit else [key // limit - 1, key % limit]
        by_length[len(ids)].append(([str(i) for i in ids], feature))
    pool: list[str] = []
    starts: list[int] = []
    indexes: list[int] = []
    for length in (1, 2):
        starts.append(len(pool))
        for ids, feature in sorted(by_length[length]):
            pool += ids
            indexes.append(feature)
    values = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    idf = values["idf"][:-1]
    coefficients = (values["weighted"][:-1] / idf[:, None]).astype(np.float32)
    nodes = [
        helper.make_node(
            "Tokenizer", ["text"], ["tokenized"], domain="com.microsoft", mark=0, mincharnum=1,
            pad_value="#", separators=[" "],
        ),
        helper.make_node("Flatten", ["tokenized"], ["flattened"]),
        helper.make_node(
            "TfIdfVectorizer", ["flattened"], ["tfidf"], mode="TFIDF", min_gram_length=1,
            max_gram_length=2, max_skip_count=0, ngram_counts=starts, ngram_indexes=indexes,
            pool_strings=pool, weights=idf[indexes].tolist(),
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
    constants = [
        onnx.numpy_helper.from_array(coefficients, "coefficients"),
        *(t for t in graph.initializer if t.name in ("intercepts", "tiny", "classes")),
    ]
    text = helper.make_tensor_value_info("text", onnx.TensorProto.STRING, [None, 1])
    old = helper.make_graph(nodes, "tfidf_logreg", [text], list(graph.output), constants)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    rebuilt = helper.make_model(old, opset_imports=opsets)
    rebuilt.ir_version = model.ir_version
    return rebuilt


def test_a_tf_idf_artifact_of_the_string_input_export_still_serves(sklearn_artifact, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(sklearn_artifact, old)
    onnx.save(_string_input_graph(onnx.load(str(old / MODEL_FILE))), str(old / MODEL_FILE))
    manifest = json.loads((old / MANIFEST_FILE).read_text())
    manifest["model"]["sha256"] = hashlib.sha256((old / MODEL_FILE).read_bytes()).hexdigest()
    (old / MANIFEST_FILE).write_text(json.dumps(manifest))
    prompts = ["Write a long essay about the sea.", "hi", "", "Say hello. " * 50]
    now = LengthPredictor.load(sklearn_artifact).probabilities(prompts)
    np.testing.assert_allclose(LengthPredictor.load(old).probabilities(prompts), now, atol=1e-6)
