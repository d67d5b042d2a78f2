"""Where the GPU benchmarks find the shared tokenizer and corpora, on this machine or the GPU's.

The GPU machine gets a copy of the checkout, not the ../shared folder beside it: an explicit
flag wins, then FEDLLM_SHARED_DIR, then ../shared and shared/ next to or inside the checkout.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from predictor.datasets import data_dir as default_data_dir

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def _first_existing(candidates: Sequence[Path]) -> Path | None:
    for path in candidates:
        if path.exists():
            return path
    return None


def shared_path(explicit: Path | None, *parts: str) -> Path:
    """An explicit path, else the first of FEDLLM_SHARED_DIR, ../shared (from the working
    directory), and shared/ next to or inside the checkout that holds `parts`."""
    if explicit is not None:
        return explicit
    roots = [Path(os.environ["FEDLLM_SHARED_DIR"])] if os.environ.get("FEDLLM_SHARED_DIR") else []
    roots += [Path("../shared"), REPO_ROOT.parent / "shared", REPO_ROOT / "shared"]
    found = _first_existing([root.joinpath(*parts) for root in roots])
    return found if found is not None else roots[-3].joinpath(*parts)


def resolve_data_dir(explicit: Path | None) -> Path:
    if explicit is not None or os.environ.get("FEDLLM_DATA_DIR"):
        return default_data_dir(explicit)
    try:
        return default_data_dir(None)
    except Exception:
        return default_data_dir(shared_path(None, "datasets"))
