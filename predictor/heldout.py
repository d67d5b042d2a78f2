"""Held-out prompts: read only to *report* a predictor whose settings are already fixed.

`../shared/heldout` (FEDLLM_HELDOUT_DIR, else FEDLLM_SHARED_DIR/heldout, else the shared folder
beside the checkout) holds data the project never trains, chooses or tunes on. This module reads
AlpacaEval's 805 instructions from `alpaca_eval.tar.xz` (every file in it holds the same
instructions with another chat model's answers; the answers are not read: the lengths that count
are the served model's own, labelled by `python -m predictor.label_served --heldout
alpaca_eval`). The records are kept apart from predictor.datasets on purpose: no training command
can name them as a corpus.
"""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

from predictor.datasets import DatasetError, PromptRecord, prompt_text

ALPACA_EVAL = "alpaca_eval"
HELDOUT_SETS: tuple[str, ...] = (ALPACA_EVAL,)
_ARCHIVE = "alpaca_eval.tar.xz"
_REPO = Path(__file__).resolve().parent.parent


def heldout_dir(explicit: str | Path | None = None) -> Path:
    """The explicit path, else FEDLLM_HELDOUT_DIR, else FEDLLM_SHARED_DIR/heldout, else the
    first of ../shared/heldout beside the checkout and shared/heldout inside it."""
    if explicit is not None:
        candidates = [Path(explicit)]
    elif os.environ.get("FEDLLM_HELDOUT_DIR"):
        candidates = [Path(os.environ["FEDLLM_HELDOUT_DIR"])]
    elif os.environ.get("FEDLLM_SHARED_DIR"):
        candidates = [Path(os.environ["FEDLLM_SHARED_DIR"]) / "heldout"]
    else:
        candidates = [_REPO.parent / "shared" / "heldout", _REPO / "shared" / "heldout"]
    for path in candidates:
        if path.is_dir():
            return path
    raise DatasetError(
        f"held-out folder not found (tried {', '.join(map(str, candidates))}): pass its path "
        "or set FEDLLM_HELDOUT_DIR"
    )


def load_alpaca_eval(directory: str | Path | None = None) -> list[PromptRecord]:
    """AlpacaEval's instructions in file order, as PromptRecords of corpus "alpaca_eval" (no
    response: the served model's answers are labelled separately)."""
    archive = heldout_dir(directory) / _ARCHIVE
    try:
        with tarfile.open(archive, "r:xz") as tar:
            members = sorted(
                (m for m in tar.getmembers() if m.isfile() and m.name.endswith(".json")),
                key=lambda m: m.name,
            )
            if not members:
                raise DatasetError(f"{archive} holds no .json file")
            handle = tar.extractfile(members[0])
            if handle is None:
                raise DatasetError(f"cannot read {members[0].name} in {archive}")
            rows = json.loads(handle.read().decode("utf-8"))
    except (OSError, tarfile.TarError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetError(f"cannot read {archive}: {exc}") from exc
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise DatasetError(f"{archive}:{members[0].name} should hold a JSON list of records")
    try:
        prompts = [prompt_text(str(r["instruction"])) for r in rows]
    except KeyError as exc:
        raise DatasetError(f"{archive}:{members[0].name}: a record has no {exc}") from exc
    return [PromptRecord(ALPACA_EVAL, i, prompt, "") for i, prompt in enumerate(prompts)]


def load_heldout(name: str, directory: str | Path | None = None) -> list[PromptRecord]:
    if name != ALPACA_EVAL:
        raise DatasetError(f"unknown held-out set {name!r}; choose one of {HELDOUT_SETS}")
    return load_alpaca_eval(directory)
