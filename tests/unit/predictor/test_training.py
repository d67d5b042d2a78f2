from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
import pytest
import torch

from predictor.artifact import load_manifest
from predictor.baseline import SklearnConfig
from predictor.finetune import (
    PRESETS,
    FinetuneConfig,
    finetune,
    length_batches,
    length_loss,
    subsample,
)
from predictor.prepare import training_fingerprint
from predictor.train import add_model_arguments, spec_from_args
from predictor.training import TrainSpec, reusable_artifact
from tests.unit.predictor.conftest import TINY_FINETUNE

SKLEARN_SPEC = TrainSpec("sklearn", "mico_n10_l1024", sklearn=SklearnConfig(max_iter=200))


def test_reuse_needs_same_data_and_config(sklearn_artifact, tiny_data):
    fingerprint = training_fingerprint(tiny_data.train)
    assert reusable_artifact(sklearn_artifact, SKLEARN_SPEC, fingerprint) is not None
    assert reusable_artifact(sklearn_artifact, SKLEARN_SPEC, "0" * 64) is None
    other = replace(SKLEARN_SPEC, sklearn=SklearnConfig(max_iter=201))
    assert reusable_artifact(sklearn_artifact, other, fingerprint) is None
    assert reusable_artifact(sklearn_artifact.parent / "absent", SKLEARN_SPEC, fingerprint) is None


def test_minilm_manifest_records_training_and_quantization(minilm_artifact, tiny_data):
    manifest = load_manifest(minilm_artifact)
    assert manifest.kind == "minilm"
    assert manifest.scheme.name == "log_n10_l1024"
    assert manifest.max_tokens == TINY_FINETUNE.max_tokens
    assert manifest.training["config"]["model"]["layers"] == 1
    assert manifest.training["records_used"] == len(tiny_data.train) * TINY_FINETUNE.epochs
    quantization = manifest.metrics["quantization"]
    assert set(quantization) == {"used", "fp32", "int8"}
    chosen = quantization["int8" if quantization["used"] else "fp32"]
    assert manifest.metrics["validation"]["all"] == chosen


def test_subsample_is_deterministic_and_bounded():
    assert subsample(100, 10, seed=3).tolist() == subsample(100, 10, seed=3).tolist()
    assert len(set(subsample(100, 10, seed=3).tolist())) == 10
    assert sorted(subsample(5, 0, seed=1).tolist()) == [0, 1, 2, 3, 4]
    assert sorted(subsample(5, 50, seed=1).tolist()) == [0, 1, 2, 3, 4]


def test_length_batches_cover_every_example_once_with_similar_lengths():
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 128, 1000)
    batches = length_batches(lengths, 32, np.random.default_rng(1))
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(1000))
    assert all(len(b) <= 32 for b in batches)
    spread = np.mean([np.ptp(lengths[b]) for b in batches])
    assert spread < 20  # sorted windows: far less than the 125-token range


def test_length_loss_is_the_expected_lengths_relative_error_and_pulls_toward_the_truth():
    reps = torch.tensor([10.0, 100.0, 400.0])  # mean representative 170
    logits = torch.zeros(2, 3, requires_grad=True)  # uniform: expected length 170 for both
    lengths = torch.tensor([10.0, 400.0])
    loss = length_loss(logits, lengths, reps)
    assert loss.item() == pytest.approx(((170 - 10) + (400 - 170)) / 2 / 170)
    loss.backward()  # type: ignore[no-untyped-call]
    assert logits.grad is not None
    # Descending the gradient moves mass toward the short bucket for the short answer and
    # toward the long bucket for the long one.
    assert logits.grad[0, 0] < 0 < logits.grad[0, 2]
    assert logits.grad[1, 2] < 0 < logits.grad[1, 0]


def test_the_length_term_needs_lengths_and_representatives():
    config = replace(TINY_FINETUNE, length_loss_weight=1.0)
    with pytest.raises(ValueError, match="lengths and bucket representatives"):
        finetune(["a"], np.zeros(1, dtype=np.int64), 2, None, config)  # type: ignore[arg-type]


def test_train_command_options_override_the_chosen_preset():
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    gpu = spec_from_args("minilm", "mico_n10_l1024", parser.parse_args(["--preset", "gpu"]))
    assert gpu.finetune == PRESETS["gpu"]
    cpu = spec_from_args("minilm", "x", parser.parse_args(["--epochs", "2", "--threads", "1"]))
    assert cpu.finetune == replace(PRESETS["cpu"], epochs=2, threads=1)
    assert cpu.eval_threads == 1


@pytest.mark.parametrize(
    ("argv", "length_feature", "per_channel"),
    [
        ([], True, False),
        (["--no-prompt-length-feature"], False, False),
        (["--preset", "gpu", "--prompt-length-feature", "--int8-per-channel"], True, True),
    ],
)
def test_train_command_switches_the_length_input_and_int8_scales(argv, length_feature, per_channel):
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    spec = spec_from_args("minilm", "mico_n10_l1024", parser.parse_args(argv))
    assert spec.finetune.prompt_length_feature is length_feature
    assert spec.int8_per_channel is per_channel
    # Either choice is part of the configuration a cached artifact is reused for.
    assert spec.config_json()["model"]["prompt_length_feature"] is length_feature
    assert spec.config_json().get("int8_per_channel", False) is per_channel


def test_warm_start_keep_is_left_out_of_the_configuration_at_its_default():
    """Artifacts built before the option keep their recorded configuration (and stay reusable);
    a value outside [0, 1) is refused."""
    assert "warm_start_keep" not in FinetuneConfig().to_json()
    assert FinetuneConfig(warm_start_keep=0.3).to_json()["warm_start_keep"] == 0.3
    with pytest.raises(ValueError, match="warm_start_keep"):
        FinetuneConfig(warm_start_keep=1.0)


def test_interpolate_weights_mixes_the_start_back_in(minilm_artifact):
    from predictor.artifact import WEIGHTS_FILE
    from predictor.finetune import interpolate_weights, load_weights
    from predictor.minilm import build_classifier

    start = minilm_artifact / WEIGHTS_FILE
    model = build_classifier(10, layers=1, length_feature=False)
    load_weights(model, start)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    interpolate_weights(model, start, keep=0.25)
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point():
            assert torch.allclose(tensor, initial[name] + 0.75, atol=1e-5), name
