"""The length predictor as the gateway runs it: an artifact directory on onnxruntime.

Importing this module loads onnxruntime, numpy and `tokenizers`, never torch or transformers.

Defined behaviour at the edges:
- an empty prompt is valid: the model reads the empty encoding ([CLS] [SEP]) and predicts
  what an empty prompt's answer length tends to be;
- a long prompt is truncated to the artifact's max_tokens (its beginning is kept), no error;
- a prompt that is not a str raises TypeError naming the type that came instead;
- with an int8 model, a prompt's probabilities can move slightly (~1e-3) with the other prompts
  in its batch: dynamic quantization scales activations per batch. fp32 models are exact.

Two kinds of MiniLM artifact load here: a classifier (the expected and p90 lengths come from
its bucket probabilities) and a classifier with a ranking head (manifest `ranking`,
predictor.score_map: the lengths come from the head's score through the manifest's map, the
bucket and probabilities still from the classifier). Both answer the same calls; `lengths` is
the vectorised form a simulator wants (arrays, no per-prompt objects).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from predictor.artifact import MODEL_FILE, ArtifactError, Manifest, load_manifest
from predictor.distribution import expected_tokens, p90_tokens
from predictor.encoding import (
    PROMPT_CHARS_INPUT,
    TEXT_INPUT,
    TOKEN_IDS_INPUT,
    PromptEncoder,
    prompt_chars,
)

# Prompts run in groups of similar token length: padding a short prompt to the longest one in a
# batch of 32 costs more than the extra session calls.
_GROUP = 16


@dataclass(frozen=True, slots=True)
class LengthPrediction:
    bucket: int  # the named bucket: argmax, with the artifact's fitted bias (predictor.decision)
    probabilities: tuple[float, ...]  # one per bucket of the artifact's scheme
    expected_tokens: float  # sum p_i * representative length_i, calibrated if the artifact is
    p90_tokens: int
    version: str
    # The value the artifact orders prompts by (higher: longer): the ranking head's score, or
    # the expected length before calibration for a classifier.
    rank_score: float = field(default=0.0, compare=False)


@dataclass(frozen=True, slots=True)
class PredictedLengths:
    """Predictions for many prompts as arrays, one entry per prompt (LengthPredictor.lengths)."""

    expected_tokens: np.ndarray  # float64, calibrated if the artifact is
    p90_tokens: np.ndarray  # float64, whole tokens
    rank_score: np.ndarray  # float64, the order the artifact ranks prompts in
    buckets: np.ndarray  # int64, the named bucket


@dataclass(frozen=True, slots=True)
class _Outputs:
    probabilities: np.ndarray  # (n, n_buckets)
    scores: np.ndarray | None  # (n,), a ranking head's score; None for a classifier


def _check_prompts(prompts: Sequence[str]) -> None:
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise TypeError(f"predict_batch takes a list of str, got {type(prompts).__name__}")
    for position, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise TypeError(
                f"a prompt must be str, got {type(prompt).__name__} at position {position}"
            )


class LengthPredictor:
    def __init__(
        self,
        manifest: Manifest,
        model: Path | bytes,
        encoder: PromptEncoder,
        threads: int = 1,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # Idle worker threads would otherwise spin on the cores the gateway and sites share.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        source = str(model) if isinstance(model, Path) else model
        self._session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        self._manifest = manifest
        self._encoder = encoder
        self._columns = np.asarray(manifest.output_buckets, dtype=np.int64)
        self._outputs = ["probabilities"]
        if manifest.ranking is not None:
            names = {node.name for node in self._session.get_outputs()}
            if manifest.ranking.output not in names:
                raise ArtifactError(
                    f"the manifest's ranking output {manifest.ranking.output!r} is not an "
                    f"output of the model (it has {sorted(names)})"
                )
            self._outputs.append(manifest.ranking.output)
        # Models with the prompt-length feature take each prompt's length as a third input;
        # artifacts from before it have two.
        inputs = {node.name for node in self._session.get_inputs()}
        self._reads_chars = PROMPT_CHARS_INPUT in inputs
        # TF-IDF artifacts of export revision 3 and later read the ids; older ones a string per
        # prompt.
        self._reads_token_ids = TOKEN_IDS_INPUT in inputs

    @classmethod
    def load(cls, path: str | Path, threads: int = 1) -> LengthPredictor:
        """Loads and validates an artifact directory (ArtifactError if anything is off)."""
        directory = Path(path)
        manifest = load_manifest(directory)
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        try:
            encoder = PromptEncoder.from_dir(directory, manifest.max_tokens)
            return cls(manifest, directory / MODEL_FILE, encoder, threads)
        except Exception as exc:  # tokenizers and onnxruntime raise bare Exception subclasses
            raise ArtifactError(f"cannot load the predictor at {directory}: {exc}") from exc

    @property
    def version(self) -> str:
        return self._manifest.version

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    def predict(self, prompt: str) -> LengthPrediction:
        if not isinstance(prompt, str):
            raise TypeError(f"a prompt must be str, got {type(prompt).__name__}")
        return self.predict_batch([prompt])[0]

    def predict_batch(self, prompts: Sequence[str]) -> list[LengthPrediction]:
        _check_prompts(prompts)
        if not prompts:
            return []
        outputs = self._forward(prompts)
        lengths = self._lengths(outputs)
        return [
            LengthPrediction(
                int(b), tuple(float(p) for p in row), float(e), int(q), self.version, float(r)
            )
            for b, row, e, q, r in zip(
                lengths.buckets,
                outputs.probabilities,
                lengths.expected_tokens,
                lengths.p90_tokens,
                lengths.rank_score,
                strict=True,
            )
        ]

    def lengths(self, prompts: Sequence[str]) -> PredictedLengths:
        """Expected and p90 tokens, the ranking value and the named bucket of every prompt, as
        arrays (one model pass; what predict_batch returns, without an object per prompt)."""
        _check_prompts(prompts)
        return self._lengths(self._forward(prompts))

    @property
    def ranks(self) -> bool:
        """Whether the artifact has a ranking head (its lengths come from a trained score)."""
        return self._manifest.ranking is not None

    def _lengths(self, outputs: _Outputs) -> PredictedLengths:
        raw, raw_p90 = self._uncalibrated(outputs)
        expected, p90 = raw, raw_p90
        if self._manifest.calibration is not None:
            expected, p90_int = self._manifest.calibration.apply(raw)
            p90 = np.asarray(p90_int, dtype=np.float64)
        rank = outputs.scores if outputs.scores is not None else raw
        buckets = self._manifest.decision.apply(outputs.probabilities)
        return PredictedLengths(
            np.asarray(expected, dtype=np.float64),
            np.asarray(p90, dtype=np.float64),
            np.asarray(rank, dtype=np.float64),
            np.asarray(buckets, dtype=np.int64),
        )

    def _uncalibrated(self, outputs: _Outputs) -> tuple[np.ndarray, np.ndarray]:
        """(expected, p90) before the artifact's calibration: from the ranking head's map, or
        from the bucket probabilities."""
        ranking = self._manifest.ranking
        if ranking is not None and outputs.scores is not None:
            expected, p90 = ranking.apply(outputs.scores)
            return expected, np.asarray(p90, dtype=np.float64)
        table = self._manifest.lengths
        expected = expected_tokens(outputs.probabilities, table)
        return expected, np.asarray(p90_tokens(outputs.probabilities, table), dtype=np.float64)

    @property
    def bucket_representatives(self) -> tuple[float, ...]:
        """Each bucket's mean training length (the expected length weighs them)."""
        return self._manifest.lengths.representatives

    def raw_expected(self, prompts: Sequence[str]) -> np.ndarray:
        """Expected lengths before the artifact's calibration (what a new calibration maps): the
        ranking head's map of its score, or the probabilities' expectation."""
        _check_prompts(prompts)
        return self._uncalibrated(self._forward(prompts))[0]

    def probabilities(self, prompts: Sequence[str]) -> np.ndarray:
        """(len(prompts), n_buckets) float64 bucket probabilities, rows summing to 1."""
        _check_prompts(prompts)
        return self._forward(prompts).probabilities

    def scores(self, prompts: Sequence[str]) -> np.ndarray:
        """The ranking head's raw score of each prompt (ArtifactError without a ranking head)."""
        _check_prompts(prompts)
        scores = self._forward(prompts).scores
        if scores is None:
            raise ArtifactError(f"{self.version} has no ranking head: it has no scores")
        return scores

    def _forward(self, prompts: Sequence[str]) -> _Outputs:
        n = len(prompts)
        probs = np.zeros((n, self._manifest.scheme.n_buckets), dtype=np.float64)
        scores = np.zeros(n, dtype=np.float64) if self.ranks else None
        if not prompts:
            return _Outputs(probs, scores)
        if self._manifest.kind == "sklearn":
            if self._reads_token_ids:
                feeds = {TOKEN_IDS_INPUT: self._encoder.token_ids(prompts)}
            else:
                text = self._encoder.id_strings(prompts)
                feeds = {TEXT_INPUT: np.array(text, dtype=object).reshape(-1, 1)}
            probs[:, self._columns] = self._run(feeds)[0]
            return _Outputs(probs, scores)
        ids, mask = self._encoder.encode(prompts)
        chars = prompt_chars(prompts)
        lengths = mask.sum(axis=1)
        order = np.argsort(lengths, kind="stable")
        for start in range(0, len(order), _GROUP):
            group = order[start : start + _GROUP]
            width = int(lengths[group].max())
            feeds = {"input_ids": ids[group, :width], "attention_mask": mask[group, :width]}
            if self._reads_chars:
                feeds[PROMPT_CHARS_INPUT] = chars[group]
            results = self._run(feeds)
            probs[np.ix_(group, self._columns)] = results[0]
            if scores is not None:
                scores[group] = results[1].reshape(-1)
        return _Outputs(probs, scores)

    def _run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        results = self._session.run(self._outputs, feeds)
        return [np.asarray(result, dtype=np.float64) for result in results]
