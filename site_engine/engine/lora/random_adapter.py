"""Random LoRA adapters written in PEFT's format, without `peft` (benchmarks, GPU tests).

The files are what `peft.PeftModel.save_pretrained` writes for a LoRA over a Llama-family model
(`adapter_config.json`, `adapter_model.safetensors` with lora_A [r, in] and lora_B [out, r] per
targeted projection): the GPU image carries no peft, and the engine reads these with
safetensors alone (lora/adapter.py). Both A and B are random (PEFT would start B at zero), so
every delta is non-zero; `scale` sets their size, as a trained adapter's would.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from site_engine.engine.lora.adapter import CONFIG_FILE, PROJECTIONS, WEIGHTS_FILE, BaseShapes

_MLP = frozenset({"gate_proj", "up_proj", "down_proj"})


def random_adapter_tensors(
    base: BaseShapes,
    rank: int,
    targets: Sequence[str] = PROJECTIONS,
    *,
    seed: int = 0,
    scale: float = 0.02,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """The safetensors dict of a random adapter, under PEFT's key names."""
    unknown = set(targets) - set(PROJECTIONS)
    if unknown:
        raise ValueError(f"unknown projections {sorted(unknown)}; known: {PROJECTIONS}")
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(base.num_layers):
        for proj in targets:
            in_f, out_f = base.features[proj]
            parent = "mlp" if proj in _MLP else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{parent}.{proj}"
            a = torch.randn(rank, in_f, generator=generator) * scale
            b = torch.randn(out_f, rank, generator=generator) * scale
            tensors[f"{key}.lora_A.weight"] = a.to(dtype)
            tensors[f"{key}.lora_B.weight"] = b.to(dtype)
    return tensors


def write_config(path: Path, rank: int, alpha: float, targets: Sequence[str]) -> None:
    """PEFT's adapter_config.json for a plain LoRA (no DoRA, biases or per-module ranks)."""
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(targets),
        "bias": "none",
        "lora_dropout": 0.0,
        "use_rslora": False,
        "use_dora": False,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")


def write_random_adapter(
    path: Path,
    base: BaseShapes,
    rank: int,
    alpha: float | None = None,
    targets: Sequence[str] = PROJECTIONS,
    *,
    seed: int = 0,
    scale: float = 0.02,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """A random adapter in PEFT's layout in `path` (created); alpha defaults to the rank
    (scaling 1)."""
    write_config(path, rank, float(rank if alpha is None else alpha), targets)
    tensors = random_adapter_tensors(base, rank, targets, seed=seed, scale=scale, dtype=dtype)
    save_file(tensors, str(path / WEIGHTS_FILE))
    return path
