"""bench/engine/lora_bytes.py: the bytes the LoRA kernels must move, on the 8B shape the issue
quotes (one rank-16 adapter on all seven projections is 83.9 MB; 256 rows' outputs read and
written are 1.41 GB a step)."""

from __future__ import annotations

from bench.engine.lora_bytes import layer_bytes, shapes_of, step_bytes
from bench.engine.model_setup import LLAMA_8B_SHAPE


def test_one_adapter_is_its_weights_and_rows_add_their_activations() -> None:
    base = shapes_of(LLAMA_8B_SHAPE)
    assert step_bytes(base, 16, 1, 0, 2) == 83_886_080
    assert step_bytes(base, 16, 64, 0, 2) == 64 * 83_886_080
    # Inputs once: 4,096 + 4,096 + 4,096 + 14,336 features; outputs twice: 43,008 columns.
    rows = step_bytes(base, 16, 0, 256, 2)
    assert rows == 32 * 256 * 2 * (26_624 + 2 * 43_008)
    names = [s.name for s in layer_bytes(base, 16, 8, 256, 2)]
    assert names == ["q_proj+k_proj+v_proj", "o_proj", "gate_proj+up_proj", "down_proj"]
