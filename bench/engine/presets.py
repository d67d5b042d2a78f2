"""What the engine benches' presets share, once: the tiny model of their CPU presets, the flags
every preset bench takes (which preset, where its model, tokenizer and results are, how long it
runs) read into the run's settings, the card's label, the KV bytes of a CPU cache, and the clocks
their drivers step on (the wall clock, or a GPU-like token clock that makes a CPU run's figures
deterministic).

A bench keeps its own PRESETS table (what it measures differs); everything around the table
comes from here, so a flag or the CPU model means the same in every bench.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from bench.common import results_dir
from bench.engine.model_setup import SMALL_SHAPE
from bench.engine.roofline import kv_block_bytes
from site_engine.model_loading import LoadedModel

# The flags that override a preset's run length, with their type and help.
RUN_FLAGS: dict[str, tuple[type, str]] = {
    "window_s": (float, "seconds of arrivals"),
    "drain_s": (float, "seconds more for them to finish"),
    "burst_requests": (int, "requests of each capacity burst"),
    "deadline_s": (float, "skip what would end later"),
}


def tiny_shape(max_positions: int) -> dict[str, Any]:
    """The CPU presets' model: SMALL_SHAPE narrowed so a 2-core machine runs a bench in minutes."""
    return {
        **SMALL_SHAPE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "head_dim": 16,
        "max_position_embeddings": max_positions,
    }


def preset_parser(
    module: str, doc: str | None, presets: Mapping[str, Any], folder: str, *run_flags: str
) -> tuple[argparse.ArgumentParser, Callable[..., Any]]:
    """The parser of `python -m <module>` with the flags every preset bench takes (the GPU
    preset by default where CUDA is), `run_flags` of RUN_FLAGS, and its `add_argument`."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc)
    add = parser.add_argument
    add("--preset", choices=sorted(presets), default="gpu" if torch.cuda.is_available() else "cpu")
    add("--model-dir", type=Path, default=None, help="built there first if empty")
    add("--tokenizer-dir", type=Path, default=None, help="default: ../shared/tokenizers/gpt2")
    add("--results-dir", type=Path, default=results_dir(folder))
    add("--name", default=None, help=f"default: {folder}_<device>")
    for key in run_flags:
        kind, help_text = RUN_FLAGS[key]
        add(f"--{key.replace('_', '-')}", type=kind, default=None, help=help_text)
    return parser, add


def chosen(args: argparse.Namespace, presets: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    """The preset `args` names, with each of `keys` its flag gave in place of the preset's."""
    p = dict(presets[args.preset])
    for key in keys:
        if getattr(args, key) is not None:
            p[key] = getattr(args, key)
    return p


def device_label(loaded: LoadedModel) -> str:
    """The card's short name for result file names (`cpu` off CUDA)."""
    if loaded.device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(loaded.device).lower()
    return next((gpu for gpu in ("h200", "h100", "a100", "l40s") if gpu in name), "gpu")


def kv_bytes(loaded: LoadedModel, blocks: int, block_size: int = 16) -> int:
    """The bytes of `blocks` KV blocks of this model: a CPU preset sizes its cache in blocks."""
    return blocks * kv_block_bytes(loaded, block_size)


class Clock(Protocol):
    def now(self) -> float: ...

    def stepped(self, tokens: int) -> float | None:
        """A step computed `tokens`: the seconds it took on this clock, None where the engine
        timed it itself (the wall clock)."""
        ...

    def idle_until(self, t: float) -> None: ...


class WallClock:
    """Seconds since the run began."""

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._start

    def stepped(self, tokens: int) -> float | None:
        return None

    def idle_until(self, t: float) -> None:
        time.sleep(max(0.0, min(t - self.now(), 0.01)))


class TokenClock:
    """A step costs `base_s + per_token_s * tokens`; idle time jumps to the next arrival."""

    def __init__(self, base_s: float, per_token_s: float = 0.0) -> None:
        self._base_s = base_s
        self._per_token_s = per_token_s
        self._t = 0.0

    def now(self) -> float:
        return self._t

    def stepped(self, tokens: int) -> float | None:
        seconds = self._base_s + self._per_token_s * tokens
        self._t += seconds
        return seconds

    def idle_until(self, t: float) -> None:
        self._t = max(self._t, t)
