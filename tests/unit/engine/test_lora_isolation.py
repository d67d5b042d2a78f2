"""One tenant's adapter cannot reach another's rows (issue 59): SmolLM2-135M-Instruct with the
peft-made adapters of test_lora_correctness and one adapter of NaN weights, written into host
memory past any load-time check (as a corrupt file that slipped through would be), in the same
steps as a second adapter's rows and the base's.

The CPU path computes each row's delta from its own slot only (lora/slots.py): every other
request must answer exactly as PeftModel.generate does, and after the NaN adapter is unloaded
its slot holds nothing of it (zeroed), and the rows that follow still answer as peft does.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from site_engine.engine.core.types import FinishReason
from site_engine.engine.lora.registry import LoraSettings
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel
from tests.unit.engine.test_lora_correctness import (
    BLOCK,
    Reference,
    loaded,
    one_thread,
    peft_model,
    reference,
    request,
    run,
)

pytestmark = pytest.mark.slow
__all__ = ["loaded", "one_thread", "peft_model"]


# Setup loads two float32 copies of the model and peft (~150 s on a free 2-core machine, ~300 s
# on a busy one): the default 300 s bound would fail the test for the machine's load.
@pytest.mark.timeout(1200)
def test_a_nan_adapter_harms_no_other_row(loaded: LoadedModel, peft_model: Reference) -> None:
    root = peft_model.adapter_root
    # Finite on disk (any load check passes); made NaN in host memory below.
    shutil.copytree(root / "all-r8", root / "poison", dirs_exist_ok=True)
    settings = LoraSettings(root, max_loras=3, max_cpu_loras=4, max_rank=16)
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=BLOCK,
                          model_name="smol", lora=settings)  # fmt: skip
    engine = PagedEngine(loaded, config)
    registry = engine.adapters
    assert registry is not None
    poison = registry.load("poison")
    for a, b in poison.weights.values():
        a.fill_(float("nan"))
        b.fill_(float("nan"))

    together = [
        request(loaded, "poison-1", "poison", "Name a colour."),
        request(loaded, "base-1", None, "Name a colour."),
        request(loaded, "r8-1", "all-r8", "Name a colour."),
        request(loaded, "poison-2", "poison", "Count to three."),
        request(loaded, "base-2", None, "Say hello in French."),
        request(loaded, "r16-1", "mlp-r16", "Name a fruit."),
    ]
    tokens, reasons, _ = run(engine, [together])
    for req in together:
        if req.adapter != "poison":
            assert tokens[req.request_id] == reference(peft_model, req), req.request_id
    assert reasons["poison-1"] in (FinishReason.STOP, FinishReason.LENGTH)

    slot = registry.slots.slot_of("poison")
    assert slot is not None
    engine.unload_adapter("poison")
    assert registry.slots.slot_of("poison") is None
    for key in registry.slots.a:
        assert not bool(registry.slots.a[key][:, slot].any()), key
        assert not bool(registry.slots.b[key][:, slot].any()), key
    assert float(registry.slots.scaling[slot]) == 0.0

    after = [
        request(loaded, "base-3", None, "Count to three."),
        request(loaded, "r8-2", "all-r8", "Say hello in French."),
        request(loaded, "r4-1", "tone-r4", "Name a fruit."),
    ]
    tokens, _, _ = run(engine, [after])
    for req in after:
        assert tokens[req.request_id] == reference(peft_model, req), req.request_id
    assert not any(torch.isnan(t).any() for t in registry.slots.a.values())
    engine.close()
