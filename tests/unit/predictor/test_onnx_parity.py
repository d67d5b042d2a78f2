"""The exported ONNX models compute what the trained models compute."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from predictor.baseline import SklearnConfig, export_sklearn_onnx, train_sklearn
from predictor.buckets import equal_width
from predictor.encoding import (
    NO_TOKEN,
    TOKEN_IDS_INPUT,
    PromptEncoder,
    pretrained_dir,
    prompt_chars,
)
from tests.unit.predictor.conftest import TINY_FINETUNE, synthetic_records

PROMPTS = [
    "Write a long essay about the sea.",
    "Spell bread.",
    "",
    "Ünïcödé prompt with 東京 and émojis 🎉?",
    "word " * 400,  # truncated
    "Classify the sentiment of: I loved it!\n\nContext on a second paragraph.",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("length_feature", "widths"),
    [(False, {}), (True, {}), (True, {"ffn_width": 256, "heads": 4})],
    ids=["ids_only", "with_prompt_chars", "narrowed"],
)
def test_minilm_onnx_matches_torch(tmp_path, length_feature, widths):
    from predictor.finetune import finetune, predict_torch
    from predictor.minilm import export_onnx

    records = synthetic_records(48)
    scheme = equal_width(10, 1024)
    encoder = PromptEncoder.from_dir(pretrained_dir(), TINY_FINETUNE.max_tokens)
    config = replace(
        TINY_FINETUNE, layers=2, epochs=1, prompt_length_feature=length_feature, **widths
    )
    model, stats = finetune(
        [r.prompt for r in records],
        scheme.buckets_of([r.length for r in records]),
        scheme.n_buckets,
        encoder,
        config,
        progress=lambda _: None,
    )
    assert stats.steps == 3
    path = tmp_path / "model.onnx"
    export_onnx(model, path)
    reference = predict_torch(model, encoder, PROMPTS)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [node.name for node in session.get_inputs()]
    assert names == ["input_ids", "attention_mask"] + (["prompt_chars"] if length_feature else [])

    def feeds(prompts: list[str]) -> dict[str, np.ndarray]:
        ids, mask = encoder.encode(prompts)
        chars = {"prompt_chars": prompt_chars(prompts)} if length_feature else {}
        return {"input_ids": ids, "attention_mask": mask, **chars}

    # One padded batch (different lengths) and each prompt alone: both must match torch.
    (batched,) = session.run(None, feeds(PROMPTS))
    np.testing.assert_allclose(batched, reference, atol=1e-5)
    for i, prompt in enumerate(PROMPTS):
        (alone,) = session.run(None, feeds([prompt]))
        np.testing.assert_allclose(alone[0], reference[i], atol=1e-5)


@pytest.mark.parametrize("classes", [10, 2])
def test_sklearn_onnx_matches_predict_proba(tmp_path, classes):
    records = synthetic_records(120)
    scheme = equal_width(classes, 1024)
    encoder = PromptEncoder.from_dir(pretrained_dir())
    texts = encoder.id_strings([r.prompt for r in records])
    pipeline = train_sklearn(
        texts, scheme.buckets_of([r.length for r in records]), SklearnConfig(max_iter=200)
    )
    path = tmp_path / "model.onnx"
    export_sklearn_onnx(pipeline, path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    prompts = PROMPTS + [r.prompt for r in records[:20]] + [""]
    # Padded to the longest prompt: NO_TOKEN stands where id_strings has nothing.
    ids = encoder.token_ids(prompts)
    labels, probabilities = session.run(None, {TOKEN_IDS_INPUT: ids})
    expected = pipeline.predict_proba(encoder.id_strings(prompts))
    np.testing.assert_allclose(probabilities, expected, atol=1e-5)
    np.testing.assert_array_equal(labels, pipeline.predict(encoder.id_strings(prompts)))
    # No n-gram the vectorizer knows (unknown ids, or none): all-zero rows, which the norm must
    # leave at zero, so the intercepts alone decide, as in scikit-learn.
    unknown = np.array([[999_999, 999_998], [NO_TOKEN, NO_TOKEN]], dtype=np.int64)
    _, probabilities = session.run(None, {TOKEN_IDS_INPUT: unknown})
    np.testing.assert_allclose(
        probabilities, pipeline.predict_proba(["999999 999998", ""]), atol=1e-5
    )
    # Every bigram is counted, none filed among the unigrams (skl2onnx's export missed some).
    vectorizer = pipeline.named_steps["tfidf"]
    bigram = next(gram for gram in vectorizer.vocabulary_ if " " in gram)
    pair = np.array([[int(token) for token in bigram.split(" ")]], dtype=np.int64)
    _, probabilities = session.run(None, {TOKEN_IDS_INPUT: pair})
    np.testing.assert_allclose(probabilities, pipeline.predict_proba([bigram]), atol=1e-5)
    # Numbers only: no string operator left for onnxruntime to run per prompt.
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert "Tokenizer" not in ops
    assert "TfIdfVectorizer" not in ops  # its dense output was most of a prediction


def test_sklearn_refuses_a_single_class():
    with pytest.raises(ValueError, match="one bucket"):
        train_sklearn(["1 2", "3 4"], np.array([0, 0]), SklearnConfig())
