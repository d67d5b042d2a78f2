"""Batched multi-adapter LoRA on real weights: SmolLM2-135M-Instruct with three random PEFT
adapters made by `peft` here, against transformers + peft `generate` (float32, CPU).

The adapters have ranks 4, 8 and 16 (mixed in one step, padded to the site's max rank) and
target different projections, one all seven. Requests of the base and of each adapter share
steps, prefix caching on, some behind one prompt prefix: a prefix cached for one adapter (or the
base) is never reused by another, while a second request of the same adapter reuses it. Each
answer must be the tokens PeftModel generates for that prompt alone with that adapter active.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.lora.registry import LoraSettings
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel
from tests.unit.engine.smollm2 import chat_ids, loaded

pytestmark = pytest.mark.slow
__all__ = ["loaded"]

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, targets)
ADAPTERS = {
    "tone-r4": (4, 8, ["q_proj", "v_proj"]),
    "all-r8": (8, 8, ATTENTION + MLP),
    "mlp-r16": (16, 24, ["k_proj", "o_proj", *MLP]),
}
BLOCK = 8
MAX_TOKENS = 8
PREFIX = (
    "Read the note and answer briefly. The note: the red door opens at nine, the blue one at ten."
)


@pytest.fixture(scope="module", autouse=True)
def one_thread(loaded: LoadedModel) -> Iterator[None]:
    """One intra-op thread (after `loaded` set two): this module runs two float32 copies of the
    model step by step, and on a shared 2-core machine two threads each were several times
    slower than one (OpenMP workers waiting on each other)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@dataclass(frozen=True)
class Reference:
    model: Any  # a peft.PeftModel over a second copy of the base, with the three adapters
    adapter_root: Path  # where it saved them, one directory each


@pytest.fixture(scope="module")
def peft_model(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """A second copy of the base with the three adapters (random A and B, so every delta is
    non-zero), saved in PEFT's format into `adapter_root` / name."""
    try:
        import peft
    except ImportError:
        pytest.fail("peft is not installed: run `make setup` (a dev dependency)")
    base = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("adapters")
    model = None
    for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        config = peft.LoraConfig(
            r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False
        )
        if model is None:
            model = peft.get_peft_model(base, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    assert model is not None
    model.save_pretrained(str(root))  # adapters other than "default" go to root / name
    model.eval()
    return Reference(model, root)


_ANSWERS: dict[tuple[tuple[int, ...], str | None], list[int]] = {}


def reference(ref: Reference, request: EngineRequest) -> list[int]:
    """PeftModel's greedy answer to the prompt alone, with the request's adapter (or none);
    each computed once per module (both parametrizations compare against the same answers)."""
    key = (request.prompt_token_ids, request.adapter)
    if key not in _ANSWERS:
        _ANSWERS[key] = _generate(ref.model, request)
    return _ANSWERS[key]


def _generate(model: Any, request: EngineRequest) -> list[int]:
    prompt = torch.tensor([request.prompt_token_ids])
    kwargs = {"attention_mask": torch.ones_like(prompt), "do_sample": False}
    with torch.inference_mode():
        if request.adapter is None:
            with model.disable_adapter():
                out = model.generate(input_ids=prompt, max_new_tokens=MAX_TOKENS, **kwargs)
        else:
            model.set_adapter(request.adapter)
            out = model.generate(input_ids=prompt, max_new_tokens=MAX_TOKENS, **kwargs)
    return list(out[0, prompt.shape[1] :].tolist())


def request(loaded: LoadedModel, rid: str, adapter: str | None, text: str) -> EngineRequest:
    ids = chat_ids(loaded, text)
    return EngineRequest(rid, ids, SamplingParams(MAX_TOKENS, temperature=0.0), adapter=adapter)


def run(engine: PagedEngine, waves: list[list[EngineRequest]]) -> tuple[dict, dict, dict]:
    """Each wave is added at once and runs to its end before the next (so its cache is there)."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}
    cached: dict[str, int] = {}
    for wave in waves:
        for req in wave:
            engine.add_request(req)
            tokens[req.request_id] = []
        steps = 0
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
                cached[out.request_id] = out.cached_prompt_tokens
                if out.finish_reason is not None:
                    reasons[out.request_id] = out.finish_reason
            steps += 1
            assert steps < 2000, "the engine stopped making progress"
    return tokens, reasons, cached


@pytest.mark.parametrize("max_loras", [3, 2])
def test_mixed_adapter_batch_answers_like_peft(
    loaded: LoadedModel, peft_model: Reference, max_loras: int
) -> None:
    """max_loras 3: every adapter in one step; 2: one adapter's requests wait for a slot."""
    root = peft_model.adapter_root
    settings = LoraSettings(root, max_loras=max_loras, max_cpu_loras=3, max_rank=16)
    config = EngineConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=BLOCK,
        model_name="smol",
        lora=settings,
    )
    engine = PagedEngine(loaded, config)
    assert engine.served_adapters() == tuple(sorted(ADAPTERS))
    shared = PREFIX + " Question:"
    first = [request(loaded, "base-p", None, shared + " when does the red door open?")]
    mixed = [
        request(loaded, "r8-p1", "all-r8", shared + " which door opens first?"),
        request(loaded, "base-p2", None, shared + " what colour is the second door?"),
        request(loaded, "r4-p", "tone-r4", shared + " how many doors are there?"),
        request(loaded, "r16-p", "mlp-r16", shared + " is the blue door open at nine?"),
        request(loaded, "r16-own", "mlp-r16", "Name a fruit."),
        request(loaded, "base-own", None, "Count to five."),
        request(loaded, "r4-own", "tone-r4", "Say hello in French."),
    ]
    last = [request(loaded, "r8-p2", "all-r8", shared + " what opens at ten?")]
    tokens, reasons, cached = run(engine, [first, mixed, last])

    for req in first + mixed + last:
        expected = reference(peft_model, req)
        assert tokens[req.request_id] == expected, req.request_id
        assert reasons[req.request_id] in (FinishReason.STOP, FinishReason.LENGTH)
    # The adapters change the answers (the test would pass for an engine that ignored them
    # otherwise): each adapter's answer to a shared-prefix prompt differs from the base's.
    for rid in ("r8-p1", "r4-p", "r16-p"):
        req = next(r for r in mixed if r.request_id == rid)
        base_answer = reference(peft_model, EngineRequest(rid, req.prompt_token_ids, req.sampling))
        assert tokens[rid] != base_answer, rid
    prefix_blocks = len(chat_ids(loaded, shared)) // BLOCK * BLOCK - BLOCK  # safely inside it
    # The base's cached prefix serves the base, never an adapter; the second request of an
    # adapter reuses the first's.
    assert cached["base-p2"] >= prefix_blocks
    assert cached["r8-p1"] == cached["r4-p"] == cached["r16-p"] == 0
    assert cached["r8-p2"] >= prefix_blocks
    engine.close()


# Unified slots (issue 69): one resident adapter holds 53 blocks of 8 tokens (19.5 MB of
# rank-16 float32 slots over 368,640 bytes a block: 2 x 30 layers x 3 heads x 64 x 4 x 8).
UNIFIED_POOL_BLOCKS = 130
BLOCK_BYTES = 368_640


def test_adapters_evicted_and_reloaded_mid_run_answer_like_peft(
    loaded: LoadedModel, peft_model: Reference
) -> None:
    """Slots out of the KV block pool: at most two adapters fit in it at once, fewer while
    sequences need the room, so adapters are evicted mid-run (for another adapter and for
    sequences' blocks) and written into a slot again later. Answers stay peft's."""
    settings = LoraSettings(
        peft_model.adapter_root, max_loras=3, max_cpu_loras=3, max_rank=16, unified=True
    )
    config = EngineConfig(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        block_size=BLOCK,
        model_name="smol",
        lora=settings,
        kv_cache_bytes=UNIFIED_POOL_BLOCKS * BLOCK_BYTES,
    )
    engine = PagedEngine(loaded, config)
    scheduler = engine._scheduler
    slots = scheduler.unified_slots
    assert slots is not None
    assert slots.blocks_per_adapter == 53
    assert scheduler.config.num_blocks == UNIFIED_POOL_BLOCKS
    first = [
        request(loaded, "u-r8-a", "all-r8", "Which door opens first, the red or the blue one?"),
        request(loaded, "u-r4-a", "tone-r4", "Say hello in French."),
        request(loaded, "u-r16-a", "mlp-r16", "Name a fruit that is red."),
        request(loaded, "u-base-a", None, "Count to five."),
    ]
    second = [
        request(loaded, "u-r4-b", "tone-r4", "How many doors are there in a house?"),
        request(loaded, "u-r16-b", "mlp-r16", "Is the blue door open at nine?"),
        request(loaded, "u-r8-b", "all-r8", "Name a colour."),
    ]
    tokens, reasons, _ = run(engine, [first, second])
    for req in first + second:
        assert tokens[req.request_id] == reference(peft_model, req), req.request_id
        assert reasons[req.request_id] in (FinishReason.STOP, FinishReason.LENGTH)
    # Three adapters never fit at once: some were evicted and written into a slot again.
    assert slots.evictions >= 2
    assert slots.loads >= 4  # 3 distinct adapters, at least one written again after eviction
    scheduler.check_invariants()
    engine.close()
