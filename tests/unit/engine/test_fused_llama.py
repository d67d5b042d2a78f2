"""The fused Llama forward (used on CUDA) against transformers, run on the CPU.

torch.compile is swapped for the plain functions here, so this checks the wiring (fused QKV and
gate/up GEMMs over views, residual/RMSNorm order, rotary) rather than the compiler.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config

from site_engine.engine.attention import TorchReferenceAttention
from site_engine.engine.core.types import SamplingParams, ScheduledChunk
from site_engine.engine.kv_cache import PagedKVCache
from site_engine.engine.model_runner import ModelRunner
from site_engine.engine.models import fused, llama_fused
from site_engine.engine.models.fused import fuse_linears
from site_engine.make_model import build_random_model

DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 128,
    "initializer_range": 0.2,
}


@pytest.fixture(autouse=True)
def _uncompiled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_fused, "_add_rms_norm", fused.add_rms_norm)
    monkeypatch.setattr(llama_fused, "_rms_norm", fused.rms_norm)
    monkeypatch.setattr(llama_fused, "_rotate_qk_compiled", fused.rotate_qk)
    monkeypatch.setattr(llama_fused, "_gated_act_compiled", fused.gated_act)


def test_fuse_linears_keeps_values_and_shares_memory() -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 3), torch.nn.Linear(8, 5)
    x = torch.randn(2, 8)
    expected = torch.cat([a(x), b(x)], dim=-1)
    weight, bias = fuse_linears([a, b])
    assert bias is not None
    assert torch.allclose(torch.nn.functional.linear(x, weight, bias), expected)
    assert a.weight.data_ptr() == weight.data_ptr()  # a view: no copy kept
    assert torch.allclose(torch.cat([a(x), b(x)], dim=-1), expected)


def test_weights_fused_under_inference_mode_can_serve_a_backward_pass() -> None:
    """The memory trial fuses under inference mode; a site's fine-tuning job then trains LoRA
    over the same weights, and autograd must be able to save them for backward."""
    linears = [torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 6, bias=False)]
    with torch.inference_mode():
        weight, _ = fuse_linears(linears)
    assert not weight.is_inference()
    assert not any(m.weight.is_inference() for m in linears)
    x = torch.randn(3, 8, requires_grad=True)
    linears[0](x).sum().backward()  # raised "Inference tensors cannot be saved for backward"
    assert x.grad is not None


def test_fusing_again_reuses_the_fused_tensors() -> None:
    """A second engine (or the memory trial's runner before the engine's) on the same model
    neither copies the weights again nor holds two copies while it builds."""
    a, b = torch.nn.Linear(8, 3, bias=False), torch.nn.Linear(8, 5, bias=False)
    weight, _ = fuse_linears([a, b])
    again, _ = fuse_linears([a, b])
    assert again is weight
    b.weight = torch.nn.Parameter(torch.randn(5, 8))  # replaced since: fused anew
    third, _ = fuse_linears([a, b])
    assert third is not weight
    assert torch.equal(third[3:], b.weight)


def test_compute_logits_writes_into_the_buffer_given() -> None:
    model = build_random_model(LlamaConfig(**DIMS), seed=2)
    flat = llama_fused.LlamaFusedFlatModel(model, TorchReferenceAttention())
    hidden = torch.randn(3, int(DIMS["hidden_size"]))
    out = torch.full((3, flat.vocab_size), float("nan"))
    with torch.inference_mode():
        got = flat.compute_logits(hidden, out=out)
        expected = flat.compute_logits(hidden)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out, expected)
    assert flat.vocab_size == DIMS["vocab_size"]


@pytest.mark.parametrize("config_class", [LlamaConfig, Qwen2Config])
def test_fused_forward_matches_transformers(config_class) -> None:
    model = build_random_model(config_class(**DIMS), seed=2)
    prompt = list(range(5, 45))
    with torch.inference_mode():
        expected = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    flat = llama_fused.LlamaFusedFlatModel(model, TorchReferenceAttention())
    runner = ModelRunner(
        model, num_blocks=16, block_size=4, device=torch.device("cpu"), dtype=torch.float32
    )
    cache = PagedKVCache(
        flat.spec, num_blocks=16, block_size=4, dtype=torch.float32, device=torch.device("cpu")
    )
    chunk = ScheduledChunk(
        "r",
        tuple(prompt),
        0,
        tuple(range(10)),
        True,
        SamplingParams(max_tokens=1, temperature=0.0),
        0,
    )
    with torch.inference_mode():
        inputs = runner.step_tensors(runner.layout_chunks([chunk]))
        hidden = flat.forward(inputs.input_ids, inputs.positions, cache, inputs.metadata)
        got = flat.compute_logits(hidden[-1:])[0]
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)


def test_the_silu_kernel_is_chosen_by_what_the_activation_computes() -> None:
    from transformers.activations import ACT2FN

    assert llama_fused._is_silu(ACT2FN["silu"])
    assert llama_fused._is_silu(torch.nn.SiLU())
    assert not llama_fused._is_silu(ACT2FN["gelu_pytorch_tanh"])
    assert not llama_fused._is_silu(torch.nn.ReLU())
