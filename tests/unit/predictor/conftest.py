"""Small synthetic corpora and tiny trained artifacts, so predictor tests run in seconds."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from predictor.baseline import SklearnConfig
from predictor.finetune import FinetuneConfig
from predictor.prepare import LabeledRecord
from predictor.training import TrainingSet, TrainSpec, train_artifact

SHORT_TASKS = ["Classify the sentiment of", "Answer yes or no:", "Name the capital of", "Spell"]
LONG_TASKS = ["Write a long essay about", "Write a detailed story about", "Explain at length"]
TOPICS = ["the sea", "a small dog", "the moon", "bread", "trains", "rain", "music", "chess"]


def synthetic_records(n: int, seed: int = 0, corpus: str = "synthetic") -> list[LabeledRecord]:
    """Prompts whose wording says the answer's length: short tasks ~20 tokens, long ~400."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        long = i % 3 == 0
        task = rng.choice(LONG_TASKS if long else SHORT_TASKS)
        length = rng.randint(250, 600) if long else rng.randint(1, 60)
        records.append(
            LabeledRecord(f"{corpus}:{i}", corpus, f"{task} {rng.choice(TOPICS)}.", length)
        )
    return records


@pytest.fixture(scope="session")
def tiny_data() -> TrainingSet:
    return TrainingSet(synthetic_records(90, seed=1), synthetic_records(30, seed=2, corpus="val"))


@pytest.fixture(scope="session")
def sklearn_artifact(tmp_path_factory: pytest.TempPathFactory, tiny_data: TrainingSet) -> Path:
    out = tmp_path_factory.mktemp("artifacts") / "sklearn"
    spec = TrainSpec("sklearn", "mico_n10_l1024", sklearn=SklearnConfig(max_iter=200))
    train_artifact(spec, tiny_data, out, progress=lambda _: None)
    return out


# Without the prompt-length input: the graph of artifacts trained before it, which must still
# load (minilm_chars_artifact has it).
TINY_FINETUNE = FinetuneConfig(
    max_train=0,
    epochs=4,
    batch_size=16,
    layers=1,
    max_tokens=32,
    learning_rate=1e-3,
    threads=2,
    prompt_length_feature=False,
)


@pytest.fixture(scope="session")
def minilm_artifact(tmp_path_factory: pytest.TempPathFactory, tiny_data: TrainingSet) -> Path:
    """A one-layer MiniLM fine-tuned for a handful of steps: wrong-ish, but a real artifact."""
    out = tmp_path_factory.mktemp("artifacts") / "minilm"
    spec = TrainSpec("minilm", "log_n10_l1024", finetune=TINY_FINETUNE)
    train_artifact(spec, tiny_data, out, progress=lambda _: None)
    return out


@pytest.fixture(scope="session")
def minilm_chars_artifact(tmp_path_factory: pytest.TempPathFactory, tiny_data: TrainingSet) -> Path:
    """The same tiny MiniLM with the prompt-length input (a three-input graph)."""
    out = tmp_path_factory.mktemp("artifacts") / "minilm_chars"
    config = replace(TINY_FINETUNE, prompt_length_feature=True)
    spec = TrainSpec("minilm", "log_n10_l1024", finetune=config)
    train_artifact(spec, tiny_data, out, progress=lambda _: None)
    return out
