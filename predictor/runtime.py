"""The length predictor as the gateway runs it: an artifact directory on onnxruntime.

Importing this module loads onnxruntime, numpy and `tokenizers`, never torch or transformers.

Defined behaviour at the edges:
- an empty prompt is valid: the model reads the empty encoding ([CLS] [SEP]) and predicts
  what an empty prompt's answer length tends to be;
- a long prompt is truncated to the artifact's max_tokens (its beginning is kept), no error;
- a prompt that is not a str raises TypeError naming the type that came instead;
- with an int8 model, a prompt's probabilities can move slightly (~1e-3) with the other prompts
  in its batch: dynamic quantization scales activations per batch. fp32 models are exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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
        self._output = "probabilities"
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
        probs = self.probabilities(prompts)
        expected, p90 = self.served_lengths(probs)
        buckets = self._manifest.decision.apply(probs)
        return [
            LengthPrediction(int(b), tuple(float(p) for p in row), float(e), int(q), self.version)
            for b, row, e, q in zip(buckets, probs, expected, p90, strict=True)
        ]

    @property
    def bucket_representatives(self) -> tuple[float, ...]:
        """Each bucket's mean training length (the expected length weighs them)."""
        return self._manifest.lengths.representatives

    def served_lengths(self, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Expected and p90 lengths of bucket probabilities, as served: through the artifact's
        calibration when it has one."""
        table = self._manifest.lengths
        expected = expected_tokens(probs, table)
        if self._manifest.calibration is not None:
            calibrated, p90 = self._manifest.calibration.apply(expected)
            return calibrated, np.asarray(p90, dtype=np.float64)
        return expected, np.asarray(p90_tokens(probs, table), dtype=np.float64)

    def raw_expected(self, prompts: Sequence[str]) -> np.ndarray:
        """Expected lengths before the artifact's calibration (what a new calibration maps)."""
        return expected_tokens(self.probabilities(prompts), self._manifest.lengths)

    def probabilities(self, prompts: Sequence[str]) -> np.ndarray:
        """(len(prompts), n_buckets) float64 bucket probabilities, rows summing to 1."""
        _check_prompts(prompts)
        out = np.zeros((len(prompts), self._manifest.scheme.n_buckets), dtype=np.float64)
        if not prompts:
            return out
        if self._manifest.kind == "sklearn":
            if self._reads_token_ids:
                feeds = {TOKEN_IDS_INPUT: self._encoder.token_ids(prompts)}
            else:
                text = self._encoder.id_strings(prompts)
                feeds = {TEXT_INPUT: np.array(text, dtype=object).reshape(-1, 1)}
            out[:, self._columns] = self._run(feeds)
            return out
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
            out[np.ix_(group, self._columns)] = self._run(feeds)
        return out

    def _run(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        (result,) = self._session.run([self._output], feeds)
        return np.asarray(result, dtype=np.float64)
