"""Loading the serving model's tokenizer, shared by the site, the gateway and the predictor.

A model directory saved by transformers carries its tokenizer (tokenizer.json); the shared
tokenizer folders carry only the raw byte-level BPE files (vocab.json + merges.txt). Both load
here into a fast transformers tokenizer. Importing this module does not import torch.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

from transformers import AutoTokenizer, GPT2TokenizerFast, PreTrainedTokenizerBase
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

BpeFamily = Literal["gpt2", "qwen2"]
# ChatML, the conversation format of Qwen, SmolLM and many other open chat models. The random
# test models carry it (make_model.py); a real model brings its own template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class TokenizerLoadError(RuntimeError):
    """The path holds no tokenizer we can load; the message says what was looked for."""


def _guess_family(vocab_path: Path) -> BpeFamily:
    # Qwen2's vocabulary (151k) and pre-tokenizer differ from GPT-2's; the size tells them apart.
    with vocab_path.open(encoding="utf-8") as handle:
        size = len(json.load(handle))
    return "qwen2" if size > 100_000 else "gpt2"


def load_tokenizer(path: str | Path, family: BpeFamily | None = None) -> PreTrainedTokenizerBase:
    """Loads a tokenizer from a transformers directory or from raw BPE vocab.json + merges.txt."""
    directory = Path(path)
    if (directory / "tokenizer.json").is_file() or (directory / "tokenizer_config.json").is_file():
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(directory))
        return tokenizer
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        raise TokenizerLoadError(
            f"no tokenizer in {directory}: expected tokenizer.json (a transformers model or "
            "tokenizer directory) or vocab.json + merges.txt (raw byte-level BPE)"
        )
    if (family or _guess_family(vocab)) == "qwen2":
        return Qwen2Tokenizer(vocab=str(vocab), merges=str(merges))
    return GPT2TokenizerFast(vocab=str(vocab), merges=str(merges))


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A stable digest of the vocabulary, so two processes can check they count tokens alike."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    digest = hashlib.sha256()
    for token, index in vocab:
        digest.update(f"{index}\t{token}\n".encode())
    return digest.hexdigest()
