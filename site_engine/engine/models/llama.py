"""Flat-batch forward pass for Llama-style decoders (Llama, Qwen2, Mistral).

It calls the loaded transformers model's own submodules (embedding, projections, norms, MLP,
rotary embedding, lm_head), so weights are shared, not copied, and every variant those modules
implement (q/k/v biases, mlp_bias, rope scaling types, tied heads) behaves exactly as in
transformers. Only the attention plumbing is replaced: tokens of all sequences form one
[T, hidden] batch and attention goes through the paged cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from site_engine.engine.attention import AttentionBackend, AttentionMetadata
from site_engine.engine.kv_cache import KVCacheSpec, PagedKVCache
from site_engine.engine.lora.slots import StepDeltas
from site_engine.engine.models import (
    child,
    child_list,
    float_attr,
    lm_head_logits,
    lm_head_rows,
)


def sliding_window_of(config: Any, layer_idx: int) -> int | None:
    """The layer's window as transformers applies it (Mistral: all layers; Qwen2: by type)."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return int(window)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, head_dim] by per-token cos/sin of shape [T, 1, head_dim]."""
    return x * cos + _rotate_half(x) * sin


@dataclass(frozen=True, slots=True)
class _DecoderLayer:
    input_layernorm: nn.Module
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module
    # The MLP's parts, for steps with LoRA rows (their deltas go inside the MLP).
    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module
    act_fn: nn.Module
    scale: float
    sliding_window: int | None


def _decoder_layer(layer: nn.Module, layer_idx: int, config: Any) -> _DecoderLayer:
    attn = child(layer, "self_attn")
    mlp = child(layer, "mlp")
    return _DecoderLayer(
        input_layernorm=child(layer, "input_layernorm"),
        q_proj=child(attn, "q_proj"),
        k_proj=child(attn, "k_proj"),
        v_proj=child(attn, "v_proj"),
        o_proj=child(attn, "o_proj"),
        post_attention_layernorm=child(layer, "post_attention_layernorm"),
        mlp=mlp,
        gate_proj=child(mlp, "gate_proj"),
        up_proj=child(mlp, "up_proj"),
        down_proj=child(mlp, "down_proj"),
        act_fn=child(mlp, "act_fn"),
        scale=float_attr(attn, "scaling"),
        sliding_window=sliding_window_of(config, layer_idx),
    )


class LlamaFlatModel:
    """Llama-family decoder over a flat batch; see `FlatCausalLM` for the contract."""

    def __init__(self, hf_model: PreTrainedModel, attention: AttentionBackend) -> None:
        config = hf_model.config
        inner = child(hf_model, "model")
        self.spec = KVCacheSpec.from_config(config)
        self.attention = attention
        self.embed_tokens = child(inner, "embed_tokens")
        self.rotary_emb = child(inner, "rotary_emb")
        self.norm = child(inner, "norm")
        self.lm_head = child(hf_model, "lm_head")
        self.vocab_size = lm_head_rows(self.lm_head)
        hf_layers = child_list(inner, "layers")[: self.spec.num_layers]
        self.layers = [_decoder_layer(layer, i, config) for i, layer in enumerate(hf_layers)]
        # The LoRA deltas of the step being run (set by the model runner), None: base only.
        self.lora: StepDeltas | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden: torch.Tensor = self.embed_tokens(input_ids)
        # The HF module takes [batch, seq] positions; the flat batch is one "row" of T tokens.
        cos, sin = self.rotary_emb(hidden, positions.unsqueeze(0))
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)
        for layer_idx, layer in enumerate(self.layers):
            residual = hidden
            normed = layer.input_layernorm(hidden)
            attn_out = self._attention(layer, layer_idx, normed, cos, sin, kv_cache, metadata)
            hidden = residual + self._project(layer_idx, "o_proj", layer.o_proj, attn_out)
            hidden = hidden + self._mlp(layer_idx, layer, layer.post_attention_layernorm(hidden))
        out: torch.Tensor = self.norm(hidden)
        return out

    def _project(self, layer_idx: int, name: str, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            out: torch.Tensor = proj(x)
            return out
        return self.lora.project(layer_idx, name, proj, x)

    def _mlp(self, layer_idx: int, layer: _DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        """The MLP as transformers' LlamaMLP computes it, with each projection's LoRA deltas."""
        if self.lora is None:
            out: torch.Tensor = layer.mlp(x)
            return out
        gate = self.lora.project(layer_idx, "gate_proj", layer.gate_proj, x)
        up = self.lora.project(layer_idx, "up_proj", layer.up_proj, x)
        return self.lora.project(layer_idx, "down_proj", layer.down_proj, layer.act_fn(gate) * up)

    def _attention(
        self,
        layer: _DecoderLayer,
        layer_idx: int,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens, head_dim = hidden.shape[0], self.spec.head_dim
        query = self._project(layer_idx, "q_proj", layer.q_proj, hidden)
        key = self._project(layer_idx, "k_proj", layer.k_proj, hidden)
        value = self._project(layer_idx, "v_proj", layer.v_proj, hidden)
        query = query.view(num_tokens, -1, head_dim)
        key = key.view(num_tokens, -1, head_dim)
        value = value.view(num_tokens, -1, head_dim)
        attended = self.attention.forward(
            apply_rotary(query, cos, sin),
            apply_rotary(key, cos, sin),
            value,
            kv_cache.key_cache(layer_idx),
            kv_cache.value_cache(layer_idx),
            metadata,
            scale=layer.scale,
            sliding_window=layer.sliding_window,
        )
        return attended.reshape(num_tokens, -1)

    def compute_logits(
        self, hidden_states: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return lm_head_logits(self.lm_head, hidden_states, out)
