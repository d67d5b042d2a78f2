"""Fused pieces of the Llama-family forward pass for CUDA.

On a GPU a decode step's time is dominated by how many kernels it launches: transformers'
RMSNorm, rotary embedding and gated MLP are chains of small elementwise kernels. Here q/k/v and
gate/up become one GEMM each (the transformers parameters become views of the fused tensors, so
no memory is duplicated and the transformers model keeps working), and the elementwise chains
are compiled into single kernels by torch.compile. The arithmetic follows transformers exactly
(RMSNorm in float32, residual adds in the model dtype).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x), as transformers' decoder layer computes them."""
    hidden = residual + x
    return rms_norm(hidden, weight, eps), hidden


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotate_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def gated_act(gate_up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """torch.compile with dynamic shapes: one kernel per chain, for every batch size."""
    return torch.compile(fn, dynamic=True, fullgraph=True)


def fuse_linears(modules: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenates the weights (and biases) of linears with the same input along the output
    dimension; each module's parameters become views of the fused tensors.

    Fusing modules that an earlier call already fused returns that call's tensors: a second
    engine on the same loaded model (or the memory trial before the engine) then neither copies
    the weights again nor holds two copies while it builds."""
    linears = [m for m in modules if isinstance(m, nn.Linear)]
    if len(linears) != len(modules):
        raise TypeError("only nn.Linear modules can be fused")
    previous = _already_fused(linears)
    if previous is not None:
        return previous
    biases = [m.bias for m in linears]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        raise TypeError("cannot fuse linears where only some have a bias")
    # Never inference tensors, even when the first fusing runs under inference mode (the memory
    # trial does): a fine-tuning job at the site trains LoRA over these same weights, and
    # autograd refuses to save an inference tensor for backward.
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in linears], dim=0)
        sizes = [m.out_features for m in linears]
        for module, piece in zip(linears, torch.split(weight, sizes, dim=0), strict=True):
            module.weight = nn.Parameter(piece, requires_grad=False)
        bias = None
        if biases[0] is not None:
            bias = torch.cat([b.detach() for b in biases if b is not None])
            for module, piece in zip(linears, torch.split(bias, sizes), strict=True):
                module.bias = nn.Parameter(piece, requires_grad=False)
    linears[0].__dict__[_FUSED] = (weight, bias)
    return weight, bias


_FUSED = "_fedllm_fused"


def _already_fused(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The tensors of an earlier fuse_linears over these modules, if their parameters are still
    the views it made (nobody replaced them since)."""
    fused = linears[0].__dict__.get(_FUSED)
    if fused is None:
        return None
    weight, bias = fused
    offset = 0
    for module in linears:
        rows = module.out_features
        if module.weight.data_ptr() != weight[offset : offset + rows].data_ptr():
            return None
        if bias is not None and (
            module.bias is None or module.bias.data_ptr() != bias[offset : offset + rows].data_ptr()
        ):
            return None
        offset += rows
    return (weight, bias) if offset == weight.shape[0] else None
