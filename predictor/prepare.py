"""Training and evaluation data for the length predictor: prompts, true lengths, fixed splits.

- The prompt is the text the gateway sees (predictor.datasets.prompt_text).
- The length is the response's token count in the serving model's tokenizer (GPT-2 by default).
  Counting ~30k responses takes a while, so counts are cached on disk, keyed by the tokenizer
  files and the responses themselves (a changed corpus or tokenizer is counted afresh).
- The split (train / validation / test) is a hash of the prompt text: a record never changes
  split between runs, and identical prompts in two corpora always share one.
- Training mixes the train split of every corpus with the curated (non-random) Alpaca rows,
  which are never tested; testing is per corpus, Alpaca's random rows being the main test set.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from predictor.datasets import PromptRecord, alpaca_random_flags, load_corpus

Split = Literal["train", "validation", "test"]
EVAL_DATASETS: tuple[str, ...] = ("alpaca_random", "dolly", "lima", "gsm8k")
TRAIN_FRACTION, VALIDATION_FRACTION = 0.8, 0.1
_REPO = Path(__file__).resolve().parent.parent
DEFAULT_TOKENIZER_DIR = _REPO.parent / "shared" / "tokenizers" / "gpt2"
DEFAULT_CACHE_DIR = _REPO / "var" / "predictor" / "cache"
Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class LabeledRecord:
    id: str  # "<corpus>:<index in load_corpus order>"
    corpus: str
    prompt: str
    length: int


@dataclass(frozen=True, slots=True)
class PreparedData:
    train: list[LabeledRecord]
    validation: list[LabeledRecord]
    test: dict[str, list[LabeledRecord]]
    tokenizer_digest: str  # of the files the lengths were counted with
    tokenizer_dir: str


def split_of(prompt: str) -> Split:
    """Fixed split of a prompt: the first 8 bytes of its SHA-256 as a fraction of 2**64."""
    value = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "big") / 2**64
    if value < TRAIN_FRACTION:
        return "train"
    return "validation" if value < TRAIN_FRACTION + VALIDATION_FRACTION else "test"


def training_fingerprint(records: Sequence[LabeledRecord]) -> str:
    """SHA-256 of the training records' ids and lengths, in training order."""
    digest = hashlib.sha256()
    for record in records:
        digest.update(f"{record.id}\t{record.length}\n".encode())
    return digest.hexdigest()


def tokenizer_dir(explicit: str | Path | None = None) -> Path:
    """The explicit path, else FEDLLM_TOKENIZER_DIR, else ../shared/tokenizers/gpt2."""
    return Path(explicit or os.environ.get("FEDLLM_TOKENIZER_DIR") or DEFAULT_TOKENIZER_DIR)


def cache_dir(explicit: str | Path | None = None) -> Path:
    """The explicit path, else FEDLLM_PREDICTOR_CACHE, else var/predictor/cache in the checkout."""
    return Path(explicit or os.environ.get("FEDLLM_PREDICTOR_CACHE") or DEFAULT_CACHE_DIR)


def tokenizer_digest(directory: Path) -> str:
    """SHA-256 over the tokenizer's files (names and bytes): cheaper than loading it."""
    digest = hashlib.sha256()
    files = sorted(p for p in directory.iterdir() if p.is_file()) if directory.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no tokenizer files in {directory}: pass --tokenizer-dir")
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


class LengthCounter:
    """Counts response tokens with the serving tokenizer, through an on-disk cache."""

    def __init__(self, tokenizer_path: Path, cache: Path, progress: Progress = print) -> None:
        self.tokenizer_path = tokenizer_path
        self.digest = tokenizer_digest(tokenizer_path)
        self._cache = cache
        self._progress = progress

    def count(self, name: str, responses: Sequence[str]) -> list[int]:
        content = hashlib.sha256(self.digest.encode())
        for response in responses:
            content.update(response.encode("utf-8") + b"\0")
        path = self._cache / f"lengths-{name}-{content.hexdigest()[:24]}.json"
        if path.is_file():
            lengths: list[int] = json.loads(path.read_text())["lengths"]
            if len(lengths) == len(responses):
                return lengths
        self._progress(
            f"counting the tokens of {len(responses)} {name} responses "
            f"(tokenizer: {self.tokenizer_path})"
        )
        lengths = self._count(responses)
        self._cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"tokenizer": self.digest, "lengths": lengths}))
        tmp.replace(path)  # atomic: a concurrent reader never sees half a file
        return lengths

    def _count(self, responses: Sequence[str]) -> list[int]:
        # Imported here: loading transformers is only needed when the cache misses.
        from fedllm_contract.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self.tokenizer_path)
        lengths: list[int] = []
        for start in range(0, len(responses), 2048):
            batch = list(responses[start : start + 2048])
            encoded = tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]
            lengths += [len(ids) for ids in encoded]
        return lengths


def _labeled(records: Sequence[PromptRecord], lengths: Sequence[int]) -> list[LabeledRecord]:
    return [
        LabeledRecord(f"{r.corpus}:{r.index}", r.corpus, r.prompt, n)
        for r, n in zip(records, lengths, strict=True)
    ]


def load_labeled(
    data: Path | None, counter: LengthCounter
) -> tuple[dict[str, list[LabeledRecord]], list[LabeledRecord]]:
    """({evaluation corpus: records}, curated Alpaca records), all with their lengths."""
    alpaca = load_corpus("alpaca", data)
    alpaca_lengths = counter.count("alpaca", [r.response for r in alpaca])
    flags = alpaca_random_flags(data)
    random_rows = load_corpus("alpaca_random", data)
    random_lengths = [n for n, is_random in zip(alpaca_lengths, flags, strict=True) if is_random]
    corpora = {"alpaca_random": _labeled(random_rows, random_lengths)}
    for name in ("dolly", "lima", "gsm8k"):
        records = load_corpus(name, data)
        corpora[name] = _labeled(records, counter.count(name, [r.response for r in records]))
    curated_pairs = [(r, n) for r, n, f in zip(alpaca, alpaca_lengths, flags, strict=True) if not f]
    curated = _labeled([r for r, _ in curated_pairs], [n for _, n in curated_pairs])
    return corpora, curated


def prepare(
    data: str | Path | None = None,
    tokenizer: str | Path | None = None,
    cache: str | Path | None = None,
    progress: Progress = print,
) -> PreparedData:
    """Every corpus with lengths, split into the training mix, validation and per-corpus tests."""
    counter = LengthCounter(tokenizer_dir(tokenizer), cache_dir(cache), progress)
    corpora, curated = load_labeled(Path(data) if data else None, counter)
    train: list[LabeledRecord] = []
    validation: list[LabeledRecord] = []
    test: dict[str, list[LabeledRecord]] = {}
    for name in EVAL_DATASETS:
        records = corpora[name]
        splits = [split_of(r.prompt) for r in records]
        train += [r for r, s in zip(records, splits, strict=True) if s == "train"]
        validation += [r for r, s in zip(records, splits, strict=True) if s == "validation"]
        test[name] = [r for r, s in zip(records, splits, strict=True) if s == "test"]
    held_out = {r.prompt for r in validation} | {r.prompt for rs in test.values() for r in rs}
    train += [r for r in curated if r.prompt not in held_out]
    return PreparedData(train, validation, test, counter.digest, str(counter.tokenizer_path))
