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
    """The graph of a TF-IDF artifact of export revision 2 (skl2onnx's): one string of ids per
    prompt, split on spaces by the com.microsoft Tokenizer, the n-grams as strings."""
    graph = model.graph
    vectorizer = next(n for n in graph.node if n.op_type == "TfIdfVectorizer")
    attributes = {a.name: helper.get_attribute_value(a) for a in vectorizer.attribute}
    attributes["pool_strings"] = [str(i) for i in attributes.pop("pool_int64s")]
    vectorizer.CopyFrom(
        helper.make_node("TfIdfVectorizer", ["flattened"], list(vectorizer.output), **attributes)
    )
    split = helper.make_node(
        "Tokenizer", ["text"], ["tokenized"], domain="com.microsoft", mark=0, mincharnum=1,
        pad_value="#", separators=[" "],
    )  # fmt: skip
    flatten = helper.make_node("Flatten", ["tokenized"], ["flattened"])
    graph.node.insert(0, flatten)
    graph.node.insert(0, split)
    del graph.input[:]
    graph.input.append(helper.make_tensor_value_info("text", onnx.TensorProto.STRING, [None, 1]))
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


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
