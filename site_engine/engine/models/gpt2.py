"""Flat-batch forward pass for GPT-2 (GPT2LMHeadModel).

Like the Llama implementation it calls the loaded model's own modules: Conv1D projections
(weights stored [in, out]), LayerNorms, the MLP with its configured activation (gelu_new), and the
tied lm_head. Learned absolute positions come from `wpe`, indexed by each token's position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from site_engine.engine.attention import AttentionBackend, AttentionMetadata
from site_engine.engine.kv_cache import KVCacheSpec, PagedKVCache
from site_engine.engine.models import (
    child,
    child_list,
    float_attr,
    lm_head_logits,
    lm_head_rows,
)


@dataclass(frozen=True, slots=True)
class _Block:
    ln_1: nn.Module
    c_attn: nn.Module
    c_proj: nn.Module
    ln_2: nn.Module
    mlp: nn.Module
    scale: float


def _block(block: nn.Module) -> _Block:
    attn = child(block, "attn")
    return _Block(
        ln_1=child(block, "ln_1"),
        c_attn=child(attn, "c_attn"),
        c_proj=child(attn, "c_proj"),
        ln_2=child(block, "ln_2"),
        mlp=child(block, "mlp"),
        # Already folds in scale_attn_weights and scale_attn_by_inverse_layer_idx.
        scale=float_attr(attn, "scaling"),
    )


class GPT2FlatModel:
    """GPT-2 over a flat batch; see `FlatCausalLM` for the contract."""

    def __init__(self, hf_model: PreTrainedModel, attention: AttentionBackend) -> None:
        config = hf_model.config
        if getattr(config, "add_cross_attention", False):
            raise ValueError("GPT-2 with cross-attention is not a causal LM the runner can serve")
        transformer = child(hf_model, "transformer")
        self.spec = KVCacheSpec.from_config(config)
        self.attention = attention
        self.wte = child(transformer, "wte")
        self.wpe = child(transformer, "wpe")
        self.ln_f = child(transformer, "ln_f")
        self.lm_head = child(hf_model, "lm_head")
        self.vocab_size = lm_head_rows(self.lm_head)
        self.blocks = [_block(block) for block in child_list(transformer, "h")]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden: torch.Tensor = self.wte(input_ids) + self.wpe(positions)
        num_tokens, head_dim = hidden.shape[0], self.spec.head_dim
        for layer_idx, block in enumerate(self.blocks):
            qkv: torch.Tensor = block.c_attn(block.ln_1(hidden))
            query, key, value = (
                part.view(num_tokens, -1, head_dim) for part in qkv.chunk(3, dim=-1)
            )
            attended = self.attention.forward(
                query,
                key,
                value,
                kv_cache.key_cache(layer_idx),
                kv_cache.value_cache(layer_idx),
                metadata,
                scale=block.scale,
            )
            hidden = hidden + block.c_proj(attended.reshape(num_tokens, -1))
            hidden = hidden + block.mlp(block.ln_2(hidden))
        out: torch.Tensor = self.ln_f(hidden)
        return out

    def compute_logits(
        self, hidden_states: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return lm_head_logits(self.lm_head, hidden_states, out)
