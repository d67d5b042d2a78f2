"""The Llama-family forward pass with fused projections and compiled elementwise chains (CUDA).

Same contract and same arithmetic as LlamaFlatModel, fewer kernels per layer: one QKV GEMM,
residual/RMSNorm as compiled kernels, rotary and the SiLU gate as Triton kernels with the head
sizes fixed (cuda/elementwise.py; other activations compiled), one gate/up GEMM. Used when the
model lives on a CUDA device; see fused.py for why.

LoRA rows (`lora`, set by the runner or, inside captured graphs, by the graphs over their static
slot-index buffer) add their deltas after each base GEMM: the q/k/v and gate/up stacks into the
fused outputs at once (one shrink and one expand each), and after o_proj and down_proj
(lora/slots.py, lora/segmented_step.py and the kernels it picks in cuda/).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional

from site_engine.engine.attention import AttentionBackend, AttentionMetadata
from site_engine.engine.kv_cache import KVCacheSpec, PagedKVCache
from site_engine.engine.lora.slots import StepDeltas
from site_engine.engine.lora.stacks import GATE_UP, QKV
from site_engine.engine.models import (
    child,
    child_list,
    float_attr,
    lm_head_logits,
    lm_head_rows,
)
from site_engine.engine.models.fused import (
    add_rms_norm,
    compiled,
    fuse_linears,
    gated_act,
    rms_norm,
    rotate_qk,
)
from site_engine.engine.models.llama import sliding_window_of

_add_rms_norm = compiled(add_rms_norm)
_rms_norm = compiled(rms_norm)
_rotate_qk_compiled = compiled(rotate_qk)
_gated_act_compiled = compiled(gated_act)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """On CUDA a Triton launch (cuda/elementwise.rms_norm says why)."""
    if x.is_cuda:
        from site_engine.engine.cuda import elementwise

        if elementwise.rms_norm_supported(x.shape[-1]):
            return elementwise.rms_norm(x, weight, eps)
    result: torch.Tensor = _rms_norm(x, weight, eps)
    return result


def _add_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda:
        from site_engine.engine.cuda import elementwise

        if elementwise.rms_norm_supported(x.shape[-1]):
            return elementwise.add_rms_norm(x, residual, weight, eps)
    result: tuple[torch.Tensor, torch.Tensor] = _add_rms_norm(x, residual, weight, eps)
    return result


def _rotate_qk(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """On CUDA the Triton kernel with the head sizes fixed (cuda/elementwise.py says why)."""
    if query.is_cuda:
        from site_engine.engine.cuda import elementwise

        if elementwise.rotary_supported(query.shape[-1]):
            return elementwise.rotate_qk(query, key, cos, sin)
    result: tuple[torch.Tensor, torch.Tensor] = _rotate_qk_compiled(query, key, cos, sin)
    return result


def _gated_act(
    gate_up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], act_is_silu: bool
) -> torch.Tensor:
    if gate_up.is_cuda and act_is_silu:
        from site_engine.engine.cuda import elementwise

        return elementwise.silu_mul(gate_up)
    result: torch.Tensor = _gated_act_compiled(gate_up, act)
    return result


@dataclass(frozen=True, slots=True)
class _Layer:
    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_size: int
    kv_size: int
    o_proj: nn.Module
    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None
    act: Callable[[torch.Tensor], torch.Tensor]
    act_is_silu: bool
    down_proj: nn.Module
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    scale: float
    sliding_window: int | None


def _norm_parts(module: nn.Module) -> tuple[torch.Tensor, float]:
    weight = module._parameters.get("weight")
    if weight is None:
        raise TypeError(f"{type(module).__name__} has no weight")
    return weight, float_attr(module, "variance_epsilon")


def _is_silu(act: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether the activation module computes SiLU (transformers' own class or torch's), by what
    it returns rather than by its class name."""
    probe = torch.tensor([-6.0, -1.5, -0.25, 0.0, 0.5, 2.0, 9.0])
    try:
        with torch.no_grad():
            return bool(torch.allclose(act(probe), functional.silu(probe), atol=1e-6))
    except Exception:
        return False


def _layer(layer: nn.Module, index: int, spec: KVCacheSpec, config: object) -> _Layer:
    attn, mlp = child(layer, "self_attn"), child(layer, "mlp")
    qkv_weight, qkv_bias = fuse_linears([child(attn, n) for n in ("q_proj", "k_proj", "v_proj")])
    gate_up_weight, gate_up_bias = fuse_linears([child(mlp, "gate_proj"), child(mlp, "up_proj")])
    input_norm, eps = _norm_parts(child(layer, "input_layernorm"))
    post_norm, _ = _norm_parts(child(layer, "post_attention_layernorm"))
    kv_size = spec.num_kv_heads * spec.head_dim
    return _Layer(
        qkv_weight=qkv_weight,
        qkv_bias=qkv_bias,
        q_size=qkv_weight.shape[0] - 2 * kv_size,
        kv_size=kv_size,
        o_proj=child(attn, "o_proj"),
        gate_up_weight=gate_up_weight,
        gate_up_bias=gate_up_bias,
        act=child(mlp, "act_fn"),
        act_is_silu=_is_silu(child(mlp, "act_fn")),
        down_proj=child(mlp, "down_proj"),
        input_norm=input_norm,
        post_norm=post_norm,
        eps=eps,
        scale=float_attr(attn, "scaling"),
        sliding_window=sliding_window_of(config, index),
    )


class LlamaFusedFlatModel:
    def __init__(self, hf_model: nn.Module, attention: AttentionBackend) -> None:
        config = hf_model.config
        inner = child(hf_model, "model")
        self.spec = KVCacheSpec.from_config(config)
        self.attention = attention
        self.embed_tokens = child(inner, "embed_tokens")
        self.rotary_emb = child(inner, "rotary_emb")
        self.final_norm, self.final_eps = _norm_parts(child(inner, "norm"))
        self.lm_head = child(hf_model, "lm_head")
        self.vocab_size = lm_head_rows(self.lm_head)
        hf_layers = child_list(inner, "layers")[: self.spec.num_layers]
        self.layers = [_layer(layer, i, self.spec, config) for i, layer in enumerate(hf_layers)]
        # The LoRA deltas of the step being run, None: base only.
        self.lora: StepDeltas | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        residual: torch.Tensor = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(residual, positions.unsqueeze(0))
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)
        first = self.layers[0]
        normed = _norm(residual, first.input_norm, first.eps)
        for index, layer in enumerate(self.layers):
            attended = self._attention(layer, index, normed, cos, sin, kv_cache, metadata)
            attn_out = layer.o_proj(attended)
            if self.lora is not None:
                self.lora.add(index, "o_proj", attended, attn_out)
            normed, residual = _add_norm(attn_out, residual, layer.post_norm, layer.eps)
            gate_up = functional.linear(normed, layer.gate_up_weight, layer.gate_up_bias)
            if self.lora is not None:
                self.lora.add_stack(index, GATE_UP, normed, gate_up)
            gated = _gated_act(gate_up, layer.act, layer.act_is_silu)
            mlp_out = layer.down_proj(gated)
            if self.lora is not None:
                self.lora.add(index, "down_proj", gated, mlp_out)
            if index + 1 < len(self.layers):
                following = self.layers[index + 1]
                normed, residual = _add_norm(mlp_out, residual, following.input_norm, following.eps)
            else:
                normed, residual = _add_norm(mlp_out, residual, self.final_norm, self.final_eps)
        return normed

    def _attention(
        self,
        layer: _Layer,
        index: int,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        tokens, head_dim = hidden.shape[0], self.spec.head_dim
        qkv = functional.linear(hidden, layer.qkv_weight, layer.qkv_bias)
        if self.lora is not None:
            self.lora.add_stack(index, QKV, hidden, qkv)
        query, key, value = torch.split(qkv, [layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        query, key = _rotate_qk(
            query.view(tokens, -1, head_dim), key.view(tokens, -1, head_dim), cos, sin
        )
        attended = self.attention.forward(
            query,
            key,
            value.view(tokens, -1, head_dim),
            kv_cache.key_cache(index),
            kv_cache.value_cache(index),
            metadata,
            scale=layer.scale,
            sliding_window=layer.sliding_window,
        )
        return attended.reshape(tokens, -1)

    def compute_logits(
        self, hidden_states: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return lm_head_logits(self.lm_head, hidden_states, out)
