"""Reading the prompt/response corpora (../shared/datasets by default; FEDLLM_DATA_DIR, else
FEDLLM_SHARED_DIR/datasets, overrides).

Each corpus becomes a list of PromptRecord with the prompt text as the gateway will see it:
the instruction, followed by its input (context) when there is one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Corpus = Literal["alpaca", "alpaca_random", "dolly", "lima", "gsm8k"]
CORPORA: tuple[Corpus, ...] = ("alpaca", "alpaca_random", "dolly", "lima", "gsm8k")
# Only these Alpaca subsets are uniform random samples; the others are quality-filtered and longer.
ALPACA_RANDOM_SOURCES = frozenset({"a5000", "r9k"})
DEFAULT_DATA_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "datasets"


class DatasetError(RuntimeError):
    """A corpus file is missing or malformed; the message names the file."""


@dataclass(frozen=True, slots=True)
class PromptRecord:
    corpus: str
    index: int
    prompt: str
    response: str


def data_dir(explicit: str | Path | None = None) -> Path:
    """The explicit path, else FEDLLM_DATA_DIR, else FEDLLM_SHARED_DIR/datasets, else
    ../shared/datasets next to the checkout."""
    shared = os.environ.get("FEDLLM_SHARED_DIR")
    chosen = (
        explicit
        or os.environ.get("FEDLLM_DATA_DIR")
        or (Path(shared) / "datasets" if shared else DEFAULT_DATA_DIR)
    )
    path = Path(chosen)
    if not path.is_dir():
        raise DatasetError(
            f"dataset folder {path} does not exist: pass --data-dir, or set FEDLLM_DATA_DIR (the "
            "datasets folder) or FEDLLM_SHARED_DIR (the folder holding datasets/ and tokenizers/)"
        )
    return path


def prompt_text(instruction: str, context: str = "") -> str:
    instruction, context = instruction.strip(), context.strip()
    return f"{instruction}\n\n{context}" if context else instruction


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    try:
        with path.open(encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise DatasetError(f"{path}:{line_number}: {exc}") from exc
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from exc


def _read_json_list(path: Path) -> list[dict[str, Any]]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from exc
    if not isinstance(rows, list):
        raise DatasetError(f"{path} should hold a JSON list of records")
    return rows


def alpaca_random_flags(directory: str | Path | None = None) -> list[bool]:
    """For each alpaca.jsonl row in file order: is it one of the uniform random samples?"""
    rows = _read_jsonl(data_dir(directory) / "alpaca.jsonl")
    return [bool(ALPACA_RANDOM_SOURCES.intersection(r.get("sources", []))) for r in rows]


def load_corpus(corpus: Corpus, directory: str | Path | None = None) -> list[PromptRecord]:
    """All records of one corpus, in file order (indexes are stable across runs)."""
    base = data_dir(directory)
    if corpus in ("alpaca", "alpaca_random"):
        rows = list(_read_jsonl(base / "alpaca.jsonl"))
        if corpus == "alpaca_random":
            rows = [r for r in rows if ALPACA_RANDOM_SOURCES.intersection(r.get("sources", []))]
        pairs = [(prompt_text(r["instruction"], r.get("input", "")), r["output"]) for r in rows]
    elif corpus == "dolly":
        rows = _read_json_list(base / "dolly_3k.json")
        pairs = [(prompt_text(r["instruction"], r.get("input", "")), r["output"]) for r in rows]
    elif corpus == "lima":
        rows = _read_json_list(base / "lima.json")
        pairs = [(prompt_text(r["instruction"], r.get("input", "")), r["output"]) for r in rows]
    elif corpus == "gsm8k":
        pairs = [
            (r["question"].strip(), r["answer"]) for r in _read_jsonl(base / "gsm8k_train.jsonl")
        ]
    else:
        raise DatasetError(f"unknown corpus {corpus!r}; choose one of {CORPORA}")
    return [PromptRecord(corpus, i, prompt, response) for i, (prompt, response) in enumerate(pairs)]
