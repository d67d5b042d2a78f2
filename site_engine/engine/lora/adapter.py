"""LoRA adapters in PEFT's format, read and checked against the served base model.

A PEFT adapter directory holds `adapter_config.json` (rank, alpha, targets...) and
`adapter_model.safetensors`, whose tensors are named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight` with A [r, in] and
B [out, r]; the delta of a projection is `x @ A.T @ B.T * scaling`, scaling = alpha / r
(alpha / sqrt(r) with rsLoRA). The config is read as JSON rather than through `peft`'s class: the
site needs a handful of its fields, and the serving image need not carry peft and its imports.

Everything is checked before anything is kept: an adapter whose rank, layers or shapes do not
fit the base, that uses a PEFT feature the engine does not apply as peft does (DoRA, aLoRA,
layer replication, biases, per-module ranks, extra trained modules...), or whose weights hold
NaN, infinite values or values past the serving dtype's range, raises AdapterError and leaves no
trace. A config without `lora_alpha` takes peft's default, 8. Messages name the adapter's files,
never the site's paths.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Re-exported: what an adapter must fit is most callers' first import from here.
from site_engine.engine.lora.adapter_shapes import PROJECTIONS as PROJECTIONS
from site_engine.engine.lora.adapter_shapes import BaseShapes as BaseShapes
from site_engine.engine.lora.host_layout import (
    HostLayout,
    LayoutRefused,
    lay_out_file,
    lay_out_pairs,
)
from site_engine.engine.lora.weights_file import (
    TensorEntry,
    WeightsFileError,
    map_file,
    map_tensors,
    read_header,
    read_small,
)

# The largest rank the engine takes at all (settings may lower it: slots are sized by it).
MAX_RANK = 64
CONFIG_FILE = "adapter_config.json"
# PEFT writes ~1 KiB; far more is not an adapter config, and is not read whole.
MAX_CONFIG_BYTES = 1 << 20
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
# Config fields that change what the adapter computes in ways the engine does not apply.
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "lora_bias": "LoRA biases",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "target_parameters": "target_parameters",
    # peft applies these at inference, and the engine does not: served, they would diverge.
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens: the adapter only from its "
    "invocation tokens on)",
    "layer_replication": "layer_replication (layers repeated into a deeper model)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "BD-LoRA (use_bdlora)",
    "kasa_config": "KaSA (kasa_config: the base weights truncated by SVD)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "arrow_config": "Arrow routing (arrow_config)",
}
# peft's LoraConfig default when a config names no lora_alpha (not the rank).
PEFT_DEFAULT_ALPHA = 8


class AdapterError(ValueError):
    """The adapter cannot be served over this base model; the message says why."""


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One adapter's weights in host memory, laid out as a device slot holds them
    (lora/host_layout.py): per stack, keyed by its first projection, (a, b) with each targeted
    (layer, projection)'s A.T [in, r] and B.T [r, out] in place, in the serving dtype, padded
    to `max_rank`; `scaling` multiplies the delta."""

    name: str
    rank: int
    scaling: float
    layout: HostLayout
    stacks: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    targets: frozenset[tuple[int, str]]  # the (layer, projection) pairs it changes

    @classmethod
    def from_pairs(
        cls,
        name: str,
        rank: int,
        scaling: float,
        weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
        base: BaseShapes,
        max_rank: int,
    ) -> LoraAdapter:
        """An adapter from its A.T [in, rank] and B.T [rank, out] per (layer, projection)."""
        layout = HostLayout(base, max_rank)
        dtype = next(iter(weights.values()))[0].dtype
        stacks = lay_out_pairs(weights, layout, rank, dtype)
        return cls(name, rank, scaling, layout, stacks, frozenset(weights))

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.stacks.values())

    @property
    def projections(self) -> frozenset[str]:
        return frozenset(proj for _, proj in self.targets)

    def pair(self, layer: int, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A.T [in, rank] and B.T [rank, out] of (layer, proj): views of its stack's tensors."""
        a_t, b_t = self.layout.views(self.stacks, self.layout.stacks, proj, self.rank)
        return a_t[layer], b_t[layer]

    @property
    def weights(self) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """Every targeted (layer, projection)'s pair (views; tests and checks, not the path)."""
        return {where: self.pair(*where) for where in sorted(self.targets)}


def _unreadable(file_name: str, exc: Exception) -> AdapterError:
    """The reason a file could not be read, by its name: an OSError's own message would show
    the site's path."""
    reason = (exc.strerror or type(exc).__name__) if isinstance(exc, OSError) else str(exc)
    return AdapterError(f"cannot read {file_name}: {reason}")


def _number(config: Mapping[str, Any], key: str, default: float | None) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AdapterError(f"{CONFIG_FILE}: {key} must be a number, got {value!r}")
    return float(value)


def read_config(path: Path, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) from the adapter's config; AdapterError for one the engine cannot serve."""
    try:
        config = json.loads(read_small(path / CONFIG_FILE, MAX_CONFIG_BYTES).decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise _unreadable(CONFIG_FILE, exc) from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise AdapterError(f"{what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"bias {config.get('bias')!r} is not supported (only 'none')")
    rank = config.get("r")
    limit = min(max_rank, MAX_RANK)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= limit:
        raise AdapterError(f"rank {rank!r} is outside 1..{limit} (this site's max_lora_rank)")
    alpha = _number(config, "lora_alpha", PEFT_DEFAULT_ALPHA)
    rslora = config.get("use_rslora", False) is True
    return rank, alpha / (math.sqrt(rank) if rslora else rank)


def _pairs(keys: Iterable[str]) -> dict[tuple[int, str], dict[str, str]]:
    """The file's tensor names by (layer, projection) and A/B."""
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key in keys:
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"tensor {key!r} is not a LoRA A/B weight of a decoder layer")
        layer, proj, which = int(match[1]), match[2], match[3]
        if proj not in PROJECTIONS:
            raise AdapterError(f"{key}: {proj} is not one of {', '.join(PROJECTIONS)}")
        pairs.setdefault((layer, proj), {})[which] = key
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    return pairs


def _check_pair(
    where: tuple[int, str],
    pair: Mapping[str, str],
    entries: Mapping[str, TensorEntry],
    rank: int,
    base: BaseShapes,
) -> None:
    layer, proj = where
    if layer >= base.num_layers:
        raise AdapterError(f"layer {layer} {proj}: the base model has {base.num_layers} layers")
    if set(pair) != {"A", "B"}:
        raise AdapterError(f"layer {layer} {proj}: lora_A and lora_B must both be present")
    in_features, out_features = base.features[proj]
    shapes = (entries[pair["A"]].shape, entries[pair["B"]].shape)
    if shapes != ((rank, in_features), (out_features, rank)):
        raise AdapterError(
            f"layer {layer} {proj}: A {list(shapes[0])} and B {list(shapes[1])} do not fit the "
            f"base ({in_features} -> {out_features}) at rank {rank}: an adapter of another model?"
        )


def check_adapter(
    path: Path, base: BaseShapes, max_rank: int
) -> tuple[int, float, dict[str, TensorEntry], dict[tuple[int, str], dict[str, str]]]:
    """(rank, scaling, the weights file's entries, its A/B names by (layer, projection)) once
    every check that needs no weight data passed (config, names, shapes); AdapterError if not."""
    rank, scaling = read_config(path, max_rank)
    try:
        entries = read_header(path / WEIGHTS_FILE)
    except (OSError, WeightsFileError) as exc:
        raise _unreadable(WEIGHTS_FILE, exc) from exc
    pairs = _pairs(entries)
    for where, pair in pairs.items():
        _check_pair(where, pair, entries, rank, base)
    return rank, scaling, entries, pairs


def read_adapter(
    path: Path, name: str, base: BaseShapes, max_rank: int, dtype: torch.dtype, pin: bool = False
) -> LoraAdapter:
    """The adapter in `path`, checked against `base`; AdapterError with the reason otherwise.
    Every check reads the config and the weights file's header only; the data is read once,
    by the copies that lay it out (weights_file.py says why not safetensors.load_file), in a
    few large copies (host_layout.py says why). `pin` (CUDA only) puts the weights in
    page-locked memory: a slot write's non-blocking copies are then asynchronous DMA, not a
    synchronous staged copy on the engine's thread."""
    rank, scaling, entries, pairs = check_adapter(path, base, max_rank)
    file = path / WEIGHTS_FILE
    layout = HostLayout(base, max_rank)
    try:
        raw = map_file(file)
    except (OSError, ValueError) as exc:
        raise _unreadable(WEIGHTS_FILE, exc) from exc
    try:
        stacks = lay_out_file(raw, entries, pairs, layout, rank, dtype, pin)
    except LayoutRefused:
        # Read again tensor by tensor: the same checks, which name the tensor that fails one.
        tensors = map_tensors(file, entries)
        weights = {
            where: (
                _checked(tensors[pair["A"]], where, "A", dtype),
                _checked(tensors[pair["B"]], where, "B", dtype),
            )
            for where, pair in pairs.items()
        }
        stacks = lay_out_pairs(weights, layout, rank, dtype, pin)
    return LoraAdapter(name, rank, scaling, layout, stacks, frozenset(pairs))


def _checked(
    weight: torch.Tensor, where: tuple[int, str], which: str, dtype: torch.dtype
) -> torch.Tensor:
    """weight.T in `dtype`, refusing weights with NaN or infinite values, or values past
    `dtype`'s range (infinite once converted): served, one such value makes every row of the
    steps the adapter shares NaN, other tenants' included, wherever a kernel adds a masked or
    zero-scaled product of it."""
    layer, proj = where
    if not bool(torch.isfinite(weight).all()):
        raise AdapterError(f"layer {layer} {proj} lora_{which} holds NaN or infinite values")
    out = weight.t().to(dtype)
    if not bool(torch.isfinite(out).all()):
        peak = float(weight.abs().max())
        limit = torch.finfo(dtype).max
        raise AdapterError(
            f"layer {layer} {proj} lora_{which} holds values up to {peak:.6g}, past the serving "
            f"dtype's range ({str(dtype).removeprefix('torch.')}: at most {limit:.6g})"
        )
    return out
