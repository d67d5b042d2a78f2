"""Real prompts with the served model's own answer lengths, and the served length predictor run
on their text: where a workload has prompts, the simulated gateway predicts as the gateway does.

The prompts are the served-model labels' held-back splits (predictor/labels/<model>: every
corpus prompt answered by the served model, its answer length in that model's tokens, the
prompt's too): validation and test by the prompt's hash (predictor/prepare.py), the splits the
served predictor was not trained on (its settings were chosen on validation; test was never
read). Their order is shuffled by a fixed seed, so a run's requests mix the corpora.

The predictor is any artifact (predictor/artifact.py: a directory with model.onnx and its
manifest) loaded with onnxruntime, as the gateway loads it (predictor/runtime.py): the served
one (`python -m predictor.served_build`), or another, such as a ranking model; the gateway's
rule makes the planned length: max(1, round(expected tokens)), and the bucket the named one.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from fedsim.traces import Lengths, TraceError
from predictor.datasets import load_corpus
from predictor.prepare import split_of
from predictor.served_labels import join_records, read_labels, read_manifest

if TYPE_CHECKING:
    from predictor.runtime import LengthPredictor

_REPO = Path(__file__).resolve().parent.parent
SERVED_LABELS = _REPO / "predictor" / "labels" / "smollm2-135m-instruct"
SERVED_ARTIFACT = _REPO / "var" / "predictor" / "smollm2-135m-instruct"
HELD_BACK = ("validation", "test")


@cache
def served_prompts(labels: Path = SERVED_LABELS) -> tuple[Lengths, ...]:
    """The labels' held-back prompts (the module docstring), in a fixed shuffled order."""
    manifest = read_manifest(labels)
    answers = read_labels(labels)
    rows: list[Lengths] = []
    for corpus in manifest.corpora:
        for record, label in join_records(load_corpus(corpus), answers):  # type: ignore[arg-type]
            if split_of(record.prompt) in HELD_BACK:
                rows.append(
                    Lengths(label.prompt_tokens, max(1, label.answer_tokens), text=record.prompt)
                )
    if not rows:
        raise TraceError(f"{labels} holds no labelled prompt of the held-back splits")
    random.Random("served-prompts").shuffle(rows)
    return tuple(rows)


class ArtifactPredictor:
    """An artifact's predictions for prompt texts, each text predicted once per process."""

    def __init__(self, artifact: Path) -> None:
        if not (artifact / "manifest.json").is_file():
            raise FileNotFoundError(
                f"no predictor artifact at {artifact}: build the served one with "
                "`python -m predictor.served_build`, or pass another artifact's directory"
            )
        # onnxruntime only for the runs that predict with it (the stand-in needs none).
        from predictor.runtime import LengthPredictor

        self.artifact = artifact
        self._model: LengthPredictor = LengthPredictor.load(artifact, threads=1)
        self._known: dict[str, tuple[int, int]] = {}

    @property
    def version(self) -> str:
        return self._model.version

    def predict(self, texts: Sequence[str]) -> list[tuple[int, int]]:
        """(planned answer tokens, bucket) of each text, as the gateway plans them."""
        todo = sorted({t for t in texts if t not in self._known})
        for start in range(0, len(todo), 64):
            batch = todo[start : start + 64]
            for text, found in zip(batch, self._model.predict_batch(batch), strict=True):
                self._known[text] = (max(1, round(found.expected_tokens)), found.bucket)
        return [self._known[t] for t in texts]


@cache
def artifact_predictor(artifact: Path) -> ArtifactPredictor:
    return ArtifactPredictor(artifact)
