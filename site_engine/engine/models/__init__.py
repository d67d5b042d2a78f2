"""Flat-batch model implementations that reuse the weights of loaded transformers models.

`build_flat_model` picks an implementation from `config.model_type`. Implementations import
lazily so that the registry (and the helpers below, which they share) can be imported without
pulling every architecture in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from transformers import PreTrainedModel

from site_engine.engine.attention import AttentionBackend, AttentionMetadata
from site_engine.engine.kv_cache import KVCacheSpec, PagedKVCache


class FlatCausalLM(Protocol):
    """A decoder that runs one flat batch of tokens from many sequences."""

    spec: KVCacheSpec
    vocab_size: int  # rows of the lm_head: the width of compute_logits' output

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final (normed) hidden states [T, hidden]."""
        ...

    def compute_logits(
        self, hidden_states: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]; the runner passes only rows it samples.
        With `out` ([N, vocab] float32) the logits are written there and it is returned."""
        ...


ModelBuilder = Callable[[PreTrainedModel, AttentionBackend], FlatCausalLM]


class UnsupportedModelError(ValueError):
    """The model's `config.model_type` has no flat-batch implementation."""


def child(parent: nn.Module, name: str) -> nn.Module:
    """The submodule `name` of `parent`, with a clear error when the layout is unexpected."""
    module = parent._modules.get(name)
    if module is None:
        raise TypeError(f"{type(parent).__name__} has no submodule {name!r}")
    return module


def child_list(parent: nn.Module, name: str) -> list[nn.Module]:
    """The modules of the ModuleList `name` of `parent` (e.g. the decoder layers)."""
    module = child(parent, name)
    if not isinstance(module, nn.ModuleList):
        raise TypeError(f"{type(parent).__name__}.{name} is not a ModuleList")
    return list(module)


def float_attr(module: nn.Module, name: str) -> float:
    """A plain numeric attribute of a transformers module (e.g. the attention `scaling`)."""
    value = module.__dict__.get(name)
    if not isinstance(value, int | float):
        raise TypeError(f"{type(module).__name__}.{name} is not a number: {value!r}")
    return float(value)


def lm_head_logits(
    lm_head: nn.Module, hidden_states: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 logits of the rows given: the one compute_logits of every flat model. Into `out`
    when given: the conversion to float32 writes there instead of into a new tensor."""
    logits: torch.Tensor = lm_head(hidden_states)
    if out is None:
        return logits.float()
    return out.copy_(logits)


def lm_head_rows(lm_head: nn.Module) -> int:
    """The vocabulary width of the lm_head's output."""
    weight = lm_head._parameters.get("weight")
    if weight is None:
        raise TypeError(f"{type(lm_head).__name__} has no weight")
    return int(weight.shape[0])


def _build_llama(model: PreTrainedModel, attention: AttentionBackend) -> FlatCausalLM:
    from site_engine.engine.models.llama import LlamaFlatModel

    if next(model.parameters()).device.type == "cuda":
        # Fewer, fused kernels: what decode speed on a GPU depends on (see models/fused.py).
        from site_engine.engine.models.llama_fused import LlamaFusedFlatModel

        return LlamaFusedFlatModel(model, attention)
    return LlamaFlatModel(model, attention)


def _build_gpt2(model: PreTrainedModel, attention: AttentionBackend) -> FlatCausalLM:
    from site_engine.engine.models.gpt2 import GPT2FlatModel

    return GPT2FlatModel(model, attention)


_REGISTRY: dict[str, ModelBuilder] = {
    "llama": _build_llama,
    "qwen2": _build_llama,
    "mistral": _build_llama,
    "gpt2": _build_gpt2,
}


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def register_model(model_type: str, builder: ModelBuilder) -> None:
    """Add (or replace) the implementation used for `model_type`."""
    _REGISTRY[model_type] = builder


def build_flat_model(model: PreTrainedModel, attention: AttentionBackend) -> FlatCausalLM:
    """The flat-batch implementation for `model`, sharing its parameters."""
    model_type = getattr(model.config, "model_type", None)
    builder = _REGISTRY.get(model_type) if isinstance(model_type, str) else None
    if builder is None:
        supported = ", ".join(supported_model_types())
        raise UnsupportedModelError(
            f"model_type {model_type!r} ({type(model).__name__}) is not supported by the model "
            f"runner; supported model types: {supported}"
        )
    return builder(model, attention)
