"""The Triton rotary and SiLU-gate kernels against the chains they replace (fused.rotate_qk,
fused.gated_act), on the strided views the fused Llama forward passes them."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from site_engine.engine.models import fused
from tests.gpu.kernel_device import skip_bf16_in_interpreter

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("tokens", "q_heads", "k_heads", "head_dim", "dtype"),
    [
        (1, 32, 8, 64, torch.bfloat16),
        (37, 32, 8, 64, torch.bfloat16),
        (130, 24, 8, 128, torch.float16),
        (5, 14, 2, 64, torch.float32),  # head counts that are not powers of two
        (70, 9, 3, 32, torch.float32),
    ],
)
def test_rotary_matches_the_compiled_chain(
    tokens: int, q_heads: int, k_heads: int, head_dim: int, dtype: torch.dtype, kernel_device: str
) -> None:
    from site_engine.engine.cuda.elementwise import rotate_qk

    skip_bf16_in_interpreter(kernel_device, dtype)
    generator = torch.Generator().manual_seed(tokens + q_heads)
    q_size, kv_size = q_heads * head_dim, k_heads * head_dim
    # q and k as the views of one QKV GEMM output the forward splits (token stride q+2kv).
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=generator).to(dtype)
    query = qkv[:, :q_size].view(tokens, q_heads, head_dim)
    key = qkv[:, q_size : q_size + kv_size].view(tokens, k_heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 50
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    expected = fused.rotate_qk(query.float(), key.float(), cos.float(), sin.float())
    device = kernel_device
    got = rotate_qk(query.to(device), key.to(device), cos.to(device), sin.to(device))
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for out, want in zip(got, expected, strict=True):
        assert out.dtype == dtype
        assert out.is_contiguous()
        torch.testing.assert_close(out.cpu().float(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    ("tokens", "width", "dtype"),
    [(1, 8192, torch.bfloat16), (33, 5632, torch.bfloat16), (7, 3000, torch.float32)],
)
def test_silu_mul_matches_the_compiled_chain(
    tokens: int, width: int, dtype: torch.dtype, kernel_device: str
) -> None:
    from site_engine.engine.cuda.elementwise import silu_mul

    skip_bf16_in_interpreter(kernel_device, dtype)
    generator = torch.Generator().manual_seed(tokens + width)
    gate_up = (torch.randn(tokens, 2 * width, generator=generator) * 4).to(dtype)
    expected = fused.gated_act(gate_up.float(), functional.silu)
    got = silu_mul(gate_up.to(kernel_device))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == (tokens, width)
    torch.testing.assert_close(got.cpu().float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    ("tokens", "width", "dtype"),
    [(1, 2048, torch.bfloat16), (37, 4096, torch.bfloat16), (9, 576, torch.float16),
     (5, 3000, torch.float32)],
)  # fmt: skip
@pytest.mark.parametrize("add", [False, True], ids=["norm", "add-norm"])
def test_rms_norm_matches_the_compiled_chain(
    tokens: int, width: int, dtype: torch.dtype, add: bool, kernel_device: str
) -> None:
    """Both forms the forward uses: the first layer's norm, and residual + x then the norm (the
    new residual returned too), on rows with a wider stride than their width."""
    from site_engine.engine.cuda.elementwise import add_rms_norm, rms_norm

    skip_bf16_in_interpreter(kernel_device, dtype)
    generator = torch.Generator().manual_seed(tokens + width)
    wide = (torch.randn(tokens, width + 8, generator=generator) * 3).to(dtype)
    x = wide[:, :width]
    residual = torch.randn(tokens, width, generator=generator).to(dtype)
    weight = (torch.rand(width, generator=generator) + 0.5).to(dtype)
    eps = 1e-5
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    device = kernel_device
    if add:
        want, want_hidden = fused.add_rms_norm(x, residual, weight, eps)
        got, hidden = add_rms_norm(x.to(device), residual.to(device), weight.to(device), eps)
        assert torch.equal(hidden.cpu(), want_hidden)  # the sum rounded once, like torch's
    else:
        want = fused.rms_norm(x, weight, eps)
        got = rms_norm(x.to(device), weight.to(device), eps)
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tolerance, rtol=tolerance)
