"""Rotary embedding and the SiLU-gated activation as Triton kernels with the feature sizes fixed.

torch.compile(dynamic=True) compiled both chains (fused.rotate_qk, fused.gated_act) with every
size symbolic, the head count and head dim included: each element then pays integer divisions
by runtime values to find its token, head and half, and the `cat` of rotate_half becomes a
select between two gathers. On an H100 prefilling 32k tokens that made the rotary kernels 18 ms
(about ten times what their bytes take) and the gated activation 16 ms (twice). Here only the
token count varies; heads, head dim and the intermediate size are compile-time constants, so a
program reads contiguous halves and the index arithmetic is shifts.

The arithmetic is the compiled chains': inputs widened to float32, one rounding at the store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_rows(x_ptr, out_ptr, cos1, sin1, cos2, sin2, tokens, token_ok,
                 stride_x_tok, stride_x_head, stride_o_tok, stride_o_head,
                 HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HALF: tl.constexpr):  # fmt: skip
    """out = x * cos + rotate_half(x) * sin for BLOCK_T tokens x every head of one tensor."""
    heads = tl.arange(0, HEADS_P2)
    offs = tl.arange(0, HALF)
    ok = token_ok[:, None, None] & (heads < HEADS)[None, :, None]
    rows = tokens.to(tl.int64)[:, None, None]
    src = x_ptr + rows * stride_x_tok + heads[None, :, None] * stride_x_head + offs[None, None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    dst = out_ptr + rows * stride_o_tok + heads[None, :, None] * stride_o_head + offs[None, None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos1 - x2 * sin1).to(dtype), mask=ok)
    tl.store(dst + HALF, (x2 * cos2 + x1 * sin2).to(dtype), mask=ok)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, num_tokens,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_cs_tok,
    stride_qo_tok, stride_qo_head, stride_ko_tok, stride_ko_head,
    Q_HEADS: tl.constexpr, Q_HEADS_P2: tl.constexpr, K_HEADS: tl.constexpr,
    K_HEADS_P2: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    offs = tl.arange(0, HALF)
    cs = tokens.to(tl.int64)[:, None] * stride_cs_tok + offs[None, :]
    cs_ok = token_ok[:, None]
    # cos/sin of each token, shared by every head: [BLOCK_T, 1, HALF]
    cos1 = tl.load(cos_ptr + cs, mask=cs_ok, other=0.0).to(tl.float32)[:, None, :]
    cos2 = tl.load(cos_ptr + cs + HALF, mask=cs_ok, other=0.0).to(tl.float32)[:, None, :]
    sin1 = tl.load(sin_ptr + cs, mask=cs_ok, other=0.0).to(tl.float32)[:, None, :]
    sin2 = tl.load(sin_ptr + cs + HALF, mask=cs_ok, other=0.0).to(tl.float32)[:, None, :]
    _rotate_rows(q_ptr, q_out_ptr, cos1, sin1, cos2, sin2, tokens, token_ok,
                 stride_q_tok, stride_q_head, stride_qo_tok, stride_qo_head,
                 Q_HEADS, Q_HEADS_P2, HALF)  # fmt: skip
    _rotate_rows(k_ptr, k_out_ptr, cos1, sin1, cos2, sin2, tokens, token_ok,
                 stride_k_tok, stride_k_head, stride_ko_tok, stride_ko_head,
                 K_HEADS, K_HEADS_P2, HALF)  # fmt: skip


def _last_dim_contiguous(*tensors: torch.Tensor) -> bool:
    return all(t.stride(-1) == 1 for t in tensors)


def rotary_supported(head_dim: int) -> bool:
    """Triton's ranges are powers of two: each half of the head dim must be one."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 1 and half & (half - 1) == 0


def rotate_qk(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused.rotate_qk for query [T, Hq, D] and key [T, Hk, D] (views with any token and head
    strides), cos and sin [T, 1, D] (or [T, D]); returns new contiguous tensors."""
    tokens, q_heads, head_dim = query.shape
    k_heads = key.shape[1]
    if not rotary_supported(head_dim):
        raise ValueError(f"head_dim {head_dim}: each half must be a power of two")
    cos2d, sin2d = cos.reshape(tokens, head_dim), sin.reshape(tokens, head_dim)
    if cos2d.stride() != sin2d.stride() or not _last_dim_contiguous(query, key, cos2d, sin2d):
        raise ValueError("rotate_qk needs unit-stride head dims and cos/sin of one layout")
    q_out = torch.empty((tokens, q_heads, head_dim), dtype=query.dtype, device=query.device)
    k_out = torch.empty((tokens, k_heads, head_dim), dtype=key.dtype, device=key.device)
    if tokens == 0:
        return q_out, k_out
    # ~16 KiB of q per program: enough bytes in flight, and many programs for short steps.
    block_t = max(1, min(64, triton.next_power_of_2(max(1, 8192 // (q_heads * head_dim)))))
    _rotary_kernel[(triton.cdiv(tokens, block_t),)](
        query, key, cos2d, sin2d, q_out, k_out, tokens,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos2d.stride(0),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        Q_HEADS=q_heads, Q_HEADS_P2=triton.next_power_of_2(q_heads),
        K_HEADS=k_heads, K_HEADS_P2=triton.next_power_of_2(k_heads),
        HALF=head_dim // 2, BLOCK_T=block_t, num_warps=4,
    )  # fmt: skip
    return q_out, k_out


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out,
    WIDTH: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < WIDTH
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + WIDTH + cols, mask=ok, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """fused.gated_act with SiLU for gate_up [T, 2 * I] (gate first): [T, I]."""
    tokens, double = gate_up.shape
    width = double // 2
    if double % 2 or gate_up.stride(-1) != 1:
        raise ValueError("silu_mul needs [T, 2 * I] with a unit-stride last dim")
    out = torch.empty((tokens, width), dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0:
        return out
    block_n = min(2048, triton.next_power_of_2(width))
    _silu_mul_kernel[(tokens, triton.cdiv(width, block_n))](
        gate_up, out, gate_up.stride(0), out.stride(0),
        WIDTH=width, BLOCK_N=block_n, num_warps=8 if block_n >= 2048 else 4,
    )  # fmt: skip
    return out


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, hidden_ptr, eps, stride_x, stride_r, stride_o,
    stride_h, WIDTH: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < WIDTH
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:
        # The sum is rounded to the input dtype first, as the residual stream holds it.
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=ok,
                                        other=0.0).to(tl.float32)).to(dtype)  # fmt: skip
        tl.store(hidden_ptr + row * stride_h + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    normed = x32 / tl.sqrt(tl.sum(x32 * x32, axis=0) / WIDTH + eps)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (weight * normed.to(dtype).to(tl.float32)).to(dtype),
             mask=ok)  # fmt: skip


def rms_norm_supported(width: int) -> bool:
    """One program holds a whole row: up to 16k features (every Llama-family width)."""
    return 0 < width <= 16384


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    tokens, width = x.shape
    if not rms_norm_supported(width) or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("rms_norm needs [T, H] rows with a unit-stride last dim, H <= 16384")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    hidden = out if residual is None else torch.empty_like(out)
    if tokens == 0:
        return out, hidden
    other = x if residual is None else residual
    if other.stride(-1) != 1:
        raise ValueError("the residual needs a unit-stride last dim")
    block = triton.next_power_of_2(width)
    _rms_norm_kernel[(tokens,)](
        x, other, weight, out, hidden, eps, x.stride(0), other.stride(0), out.stride(0),
        hidden.stride(0), WIDTH=width, BLOCK=block, ADD=residual is not None,
        num_warps=8 if block >= 4096 else 4,
    )  # fmt: skip
    return out, hidden


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fused.rms_norm for x [T, H]. A Triton launch rather than the torch.compile'd chain: the
    compiled call's guards cost ~0.2 ms of host time each, which an eager step (one that no
    CUDA graph holds: long chunks for cuDNN) pays twice a layer."""
    return _rms_norm(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused.add_rms_norm for x and residual [T, H]: (rms_norm(residual + x), residual + x)."""
    return _rms_norm(x, residual, weight, eps)
