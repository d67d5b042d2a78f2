"""The LoRA kernels (site_engine/engine/cuda/lora_segmented.py) and LoRA on CUDA.

- the shrink and expand against a float64 reference, fresh random data on every run: stacks of
  one to three projections, 64 slots of mixed ranks 4-16 (zero-padded to 16), rows of no
  adapter (untouched, bit for bit), 1..256 tokens, the deltas into a column slice of a wider
  output (the fused q/k/v and gate/up GEMMs' outputs); a slot of NaN reaches no other row;
- the kernels' step against the PyTorch path's segmented step over the same slots, every
  stack at once and each projection alone;
- the engine on CUDA: with graphs (decode and flat step graphs capturing the LoRA kernels over
  their static slot-index buffers) token for token the same as without graphs, with more
  adapters than slots (slots rewritten in place between replays), in float32; and in bfloat16
  the fused model's logits with the kernels within bf16 tolerance of the PyTorch path's.

The kernel tests run on the GPU in bfloat16, or under TRITON_INTERPRET=1 on the CPU in float32
(tests/gpu/kernel_device.py); the engine tests need the GPU.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from fedllm_contract.tokenizer import load_tokenizer
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams, ScheduledChunk
from site_engine.engine.lora.adapter import PROJECTIONS, BaseShapes
from site_engine.engine.lora.random_adapter import write_random_adapter
from site_engine.engine.lora.registry import AdapterRegistry, LoraSettings
from site_engine.engine.lora.segmented_step import SegmentedLoraStep, launcher
from site_engine.engine.lora.slots import LoraSlots, SegmentedTorchStep, StepDeltas
from site_engine.engine.lora.stacks import GATE_UP, QKV
from site_engine.engine.model_runner import ModelRunner
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.make_model import build_random_model
from site_engine.model_loading import load_model
from tests.support.lora_weights import mixed_adapters, random_adapter, reference, small_shapes

pytestmark = pytest.mark.gpu

RANKS = (4, 8, 12, 16)  # mixed in one step, zero-padded to the slots' max rank (16)
WIDE_RANKS = (4, 16, 32, 64)  # a site of max rank 64 (the widest tiles the kernels take)


def _dtype(device: str) -> torch.dtype:
    # Triton's interpreter computes bfloat16 wrongly (kernel_device.py): float32 there.
    return torch.bfloat16 if device == "cuda" else torch.float32


def _fresh_seed() -> int:
    """New random data on every run (the kernels must hold for any), named in failures."""
    return random.SystemRandom().randrange(2**31)


def _stack_slots(
    in_f: int, widths: tuple[int, ...], slots: int, max_rank: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [slots, in, len(widths) * max_rank] and B [slots, max_rank, sum(widths)] as LoraSlots
    lays a stack out, each slot of a random rank up to max_rank (zero past it), and each slot's
    scaling."""
    ranks = RANKS if max_rank == 16 else WIDE_RANKS
    parts = len(widths)
    a = torch.randn(slots, in_f, parts * max_rank, generator=gen) * 0.05
    b = torch.randn(slots, max_rank, sum(widths), generator=gen) * 0.05
    for slot in range(slots):
        rank = ranks[int(torch.randint(len(ranks), (1,), generator=gen))]
        a.view(slots, in_f, parts, max_rank)[slot, :, :, rank:] = 0
        b[slot, rank:] = 0
    scaling = 0.5 + torch.rand(slots, generator=gen) * 1.5
    return a, b, scaling


# One projection and stacks of two and three (q/k/v-like widths, not multiples of the kernels'
# column block); input widths that split the shrink's reduction differently; 1..256 tokens;
# tiles of 16 tokens (decode-sized steps) and of 64 (prefill-sized ones); max rank 16 and 64;
# shrinks of 1 to 16 splits.
@pytest.mark.parametrize(
    ("tokens", "in_f", "widths", "block_m", "max_rank"),
    [
        (1, 2560, (384,), 16, 16),
        (7, 1024, (200, 200), 64, 16),
        (64, 1536, (256, 72, 72), 16, 16),
        (150, 1024, (128, 64, 64), 64, 16),
        (256, 2048, (96,), 16, 16),
        (40, 1024, (128, 64, 64), 64, 64),
        (32, 8192, (320, 64), 16, 16),  # 16 shrink splits (the expand's widest unrolled sum)
        (256, 4096, (4096, 1024, 1024), 16, 16),  # the 8B q/k/v stack: whole blocks (EVEN_N)
    ],
)
def test_kernels_match_thereference(
    tokens: int,
    in_f: int,
    widths: tuple[int, ...],
    block_m: int,
    max_rank: int,
    kernel_device: str,
) -> None:
    seed = _fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    device, dtype = kernel_device, _dtype(kernel_device)
    slots, out_f = 64, sum(widths)
    a, b, scaling = _stack_slots(in_f, widths, slots, max_rank, gen)
    x = torch.randn(tokens, in_f, generator=gen).to(dtype)
    # Every slot in use at 256 tokens; a quarter of the rows with no adapter.
    token_slots = torch.randint(0, slots, (tokens,), generator=gen)
    token_slots[torch.rand(tokens, generator=gen) < 0.25] = -1
    # The deltas go into the middle columns of a wider output (a fused GEMM's slice).
    wide = torch.randn(tokens, out_f + 96, generator=gen).to(dtype)
    a, b, scaling = a.to(dtype), b.to(dtype), scaling.to(dtype)
    expected = reference(x, a, b, scaling, token_slots, wide[:, 32 : 32 + out_f], widths)

    got = wide.to(device).clone()
    _apply(token_slots, slots, block_m, x, a, b, scaling, got[:, 32 : 32 + out_f], widths)
    got = got.cpu()

    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(
        got[:, 32 : 32 + out_f].double(), expected, atol=tolerance, rtol=tolerance,
        msg=lambda m: f"seed {seed}: {m}",
    )  # fmt: skip
    # Rows of no adapter, and the columns beside the slice, are left exactly as they were.
    base_rows = token_slots < 0
    assert torch.equal(got[base_rows], wide[base_rows]), seed
    assert torch.equal(got[:, :32], wide[:, :32]), seed
    assert torch.equal(got[:, 32 + out_f :], wide[:, 32 + out_f :]), seed
    # A kernel that dropped the deltas must fail: most adapter rows' expected deltas are large
    # beside the tolerance (a low-rank slot can give a small one, so not all: on the GPU that
    # made this check flaky), and every such row moved.
    want = (expected - wide[:, 32 : 32 + out_f].double()).abs().amax(dim=1)[~base_rows]
    moved = (got - wide)[~base_rows].abs().amax(dim=1).double()
    large = want > 10 * tolerance
    # (A step of one token is a base row a quarter of the time: then no row has a delta.)
    assert want.numel() == 0 or bool(large.float().mean() >= 0.5), (seed, want)
    assert bool((moved[large] > 5 * tolerance).all()), seed


def _apply(
    token_slots: torch.Tensor, slots: int, block_m: int | None, x: torch.Tensor,
    a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor, y: torch.Tensor,
    widths: tuple[int, ...],
) -> None:  # fmt: skip
    """y (on the kernels' device) += the deltas, the kernels' tiles of `block_m` rows (None:
    the step's own)."""
    from site_engine.engine.cuda import lora_segmented

    device = y.device
    token_slots = token_slots.to(device)
    x, a, b, scaling = x.to(device), a.to(device), b.to(device), scaling.to(device)
    tiles = lora_segmented.segments(token_slots, slots, block_m)
    shrunk = lora_segmented.lora_shrink(x, a, scaling, tiles)
    lora_segmented.lora_expand(shrunk, b, y, tiles, widths)


def test_a_nan_slot_reaches_no_other_row(kernel_device: str) -> None:
    """A slot full of NaN (written past any load check): its own rows only are NaN."""
    gen = torch.Generator().manual_seed(_fresh_seed())
    device, dtype = kernel_device, _dtype(kernel_device)
    widths = (64, 32, 32)
    a, b, scaling = _stack_slots(256, widths, 4, 16, gen)
    a[2] = float("nan")
    b[2] = float("nan")
    token_slots = torch.tensor([2, 0, -1, 2, 1, -1, 3, 0] * 4)
    x = torch.randn(token_slots.shape[0], 256, generator=gen).to(dtype)
    y = torch.randn(token_slots.shape[0], sum(widths), generator=gen).to(dtype)
    a, b, scaling = a.to(dtype), b.to(dtype), scaling.to(dtype)
    expected = reference(x, a, b, scaling, token_slots, y, widths)
    got = y.to(device).clone()
    _apply(token_slots, 4, None, x, a, b, scaling, got, widths)
    got = got.cpu()
    poisoned = token_slots == 2
    assert bool(got[poisoned].isnan().all())
    assert not bool(got[~poisoned].isnan().any())
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got[~poisoned].double(), expected[~poisoned], atol=tolerance,
                               rtol=tolerance)  # fmt: skip


def test_the_kernels_step_matches_the_pytorch_step(kernel_device: str) -> None:
    device, dtype = kernel_device, _dtype(kernel_device)
    base = small_shapes()
    slots = LoraSlots(base, num_slots=6, max_rank=16, dtype=dtype, device=torch.device(device))
    adapters = mixed_adapters(base)
    by_name = {adapter.name: adapter for adapter in adapters}
    assigned = slots.assign(by_name, by_name.__getitem__)
    rng = random.Random(_fresh_seed())
    names = ["", *by_name]
    token_slots = torch.tensor([-1 if not n else assigned[n] for n in rng.choices(names, k=40)])
    token_slots = token_slots.to(device)
    kernels = SegmentedLoraStep(slots, launcher(token_slots, slots.num_slots))
    reference = SegmentedTorchStep(slots, token_slots)
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4
    for layer in range(base.num_layers):
        for projections in (QKV, ("o_proj",), GATE_UP, ("down_proj",)):
            in_f = base.features[projections[0]][0]
            out_f = sum(base.features[p][1] for p in projections)
            x = torch.randn(40, in_f, generator=generator).to(dtype).to(device)
            y = torch.randn(40, out_f, generator=generator).to(dtype).to(device)
            want, got, each = y.clone(), y.clone(), y.clone()
            reference.add_stack(layer, projections, x, want)
            kernels.add_stack(layer, projections, x, got)
            first = 0
            for proj in projections:  # one projection of a stack alone: its columns only
                width = base.features[proj][1]
                kernels.add(layer, proj, x, each[:, first : first + width])
                first += width
            torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
            torch.testing.assert_close(each.float(), want.float(), atol=tolerance, rtol=tolerance)
            assert not torch.equal(want, y), (layer, projections)


# The engine tests: a small Llama on the GPU and four random PEFT adapters of mixed ranks.
CONFIG = LlamaConfig(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=50304, max_position_embeddings=256, initializer_range=0.2,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
ADAPTERS = {  # name -> (rank, targets)
    "all-r16": (16, PROJECTIONS),
    "attn-r4": (4, ("q_proj", "k_proj", "v_proj", "o_proj")),
    "mlp-r8": (8, ("gate_proj", "up_proj", "down_proj")),
    "all-r12": (12, PROJECTIONS),
}


def _model_dir(tmp_path: Path, tokenizer_dir: Path) -> Path:
    model_dir = tmp_path / "model"
    build_random_model(CONFIG, seed=1).save_pretrained(str(model_dir))
    load_tokenizer(tokenizer_dir).save_pretrained(str(model_dir))
    return model_dir


def _adapter_dir(tmp_path: Path, model_dir: Path) -> Path:
    root = tmp_path / "adapters"
    base = BaseShapes.of_model(load_model(model_dir).model)
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        write_random_adapter(root / name, base, rank, 2 * rank, targets, seed=seed, scale=0.1,
                             dtype=torch.float32)  # fmt: skip
    return root


def _requests() -> list[EngineRequest]:
    rng = random.Random(7)
    names: list[str | None] = [None, *ADAPTERS]
    shared = [rng.randrange(512) for _ in range(20)]
    requests = []
    for i in range(14):
        own = [rng.randrange(512) for _ in range(rng.randrange(3, 40))]
        prompt = (shared + own) if i % 3 == 0 else own
        sampling = SamplingParams(max_tokens=rng.randrange(6, 16), temperature=0.0)
        requests.append(
            EngineRequest(f"r{i}", tuple(prompt), sampling, adapter=names[i % len(names)])
        )
    # The same prompt for the base and every adapter: the adapters must change the answer.
    probe = [rng.randrange(512) for _ in range(12)]
    for name in names:
        sampling = SamplingParams(max_tokens=12, temperature=0.0)
        requests.append(EngineRequest(f"probe-{name}", tuple(probe), sampling, adapter=name))
    return requests


def _run(engine: PagedEngine, requests: list[EngineRequest]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    pending = list(requests)
    steps = 0
    while pending or engine.has_unfinished():
        for _ in range(min(3, len(pending))):  # arrivals while others run
            engine.add_request(pending.pop(0))
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        steps += 1
        assert steps < 5000, "the engine stopped making progress"
    return tokens


def test_engine_with_graphs_matches_eager_with_adapters(
    cuda_device: str, tmp_path: Path, gpt2_tokenizer_dir: Path
) -> None:
    model_dir = _model_dir(tmp_path, gpt2_tokenizer_dir)
    root = _adapter_dir(tmp_path, model_dir)
    answers = {}
    for graphs in (True, False):
        loaded = load_model(model_dir, device=cuda_device)
        # Three slots for four adapters: slots are rewritten between the graphs' replays.
        lora = LoraSettings(root, max_loras=3, max_cpu_loras=4, max_rank=16)
        config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=8,
                              kv_cache_bytes=8 << 20, cuda_graphs=graphs, lora=lora)  # fmt: skip
        engine = PagedEngine(loaded, config)
        if graphs:
            assert engine._runner.num_graphs > 0
        answers[graphs] = _run(engine, _requests())
        engine.close()
    assert answers[True] == answers[False]
    probes = {rid: t for rid, t in answers[True].items() if rid.startswith("probe-")}
    assert len({tuple(t) for t in probes.values()}) == len(probes), probes


class _CountedGraph:
    """A captured graph that counts its replays."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph, self.replays = graph, 0

    def replay(self) -> None:
        self.replays += 1
        self.graph.replay()

    def reset(self) -> None:
        self.graph.reset()


def _count_replays(buckets: dict[int, Any]) -> list[_CountedGraph]:
    counted = []
    for bucket in buckets.values():
        bucket.graph = _CountedGraph(bucket.graph)
        counted.append(bucket.graph)
    return counted


def test_steps_without_adapters_replay_the_base_graphs(
    cuda_device: str, tmp_path: Path, gpt2_tokenizer_dir: Path
) -> None:
    """A LoRA engine keeps a base-model graph per bucket beside each LoRA graph; steps whose
    rows have no adapter replay it (no LoRA launch at all), steps with one the LoRA graph, and
    base requests answer as an engine without LoRA does."""
    model_dir = _model_dir(tmp_path, gpt2_tokenizer_dir)
    root = _adapter_dir(tmp_path, model_dir)
    base_requests = [r for r in _requests() if r.adapter is None]
    answers = {}
    for lora in (LoraSettings(root, max_loras=3, max_cpu_loras=4, max_rank=16), None):
        loaded = load_model(model_dir, device=cuda_device)
        config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=8,
                              kv_cache_bytes=8 << 20, cuda_graphs=True, lora=lora)  # fmt: skip
        engine = PagedEngine(loaded, config)
        if lora is None:
            answers[False] = _run(engine, base_requests)
            engine.close()
            continue
        sets = [engine._runner.graphs, engine._runner.step_graphs]
        assert all(g is not None and g._base_captured.keys() == g._captured.keys() for g in sets)
        with_lora = [c for g in sets for c in _count_replays(g._captured)]  # type: ignore[union-attr]
        base = [c for g in sets for c in _count_replays(g._base_captured)]  # type: ignore[union-attr]
        answers[True] = _run(engine, base_requests)
        assert sum(c.replays for c in with_lora) == 0
        assert sum(c.replays for c in base) > 0
        adapted = [r for r in _requests() if r.adapter is not None]
        _run(engine, [dataclasses.replace(r, request_id=f"a-{r.request_id}") for r in adapted])
        assert sum(c.replays for c in with_lora) > 0
        engine.close()
    assert answers[True] == answers[False]


def test_fused_model_deltas_match_the_pytorch_path_in_bf16(
    cuda_device: str, tmp_path: Path, gpt2_tokenizer_dir: Path
) -> None:
    model_dir = _model_dir(tmp_path, gpt2_tokenizer_dir)
    root = _adapter_dir(tmp_path, model_dir)
    loaded = load_model(model_dir, device=cuda_device, dtype="bfloat16")
    device = torch.device(cuda_device)
    settings = LoraSettings(root, max_loras=4, max_cpu_loras=4, max_rank=16)
    registry = AdapterRegistry(settings, BaseShapes.of_model(loaded.model), loaded.dtype, device)
    for name in ADAPTERS:
        registry.load(name)
    runner = ModelRunner(loaded.model, num_blocks=64, block_size=8, device=device,
                         dtype=loaded.dtype, adapters=registry)  # fmt: skip
    rng = random.Random(8)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    chunks, block = [], 0
    for i, name in enumerate(["", *ADAPTERS, "all-r16", ""]):
        count = rng.randrange(1, 30)
        table = tuple(range(block, block + -(-count // 8)))
        block += len(table)
        tokens = tuple(rng.randrange(512) for _ in range(count))
        chunks.append(ScheduledChunk(f"c{i}", tokens, 0, table, True, greedy, 0, adapter=name))
    layout = runner.layout_chunks(chunks)
    inputs = runner.step_tensors(layout)
    assert type(inputs.lora).__name__ == "SegmentedLoraStep"
    sample_index = torch.tensor(layout.sample_index, device=device)
    token_slots = torch.tensor(
        [s for c, s in zip(chunks, registry.assign([c.adapter for c in chunks]), strict=True)
         for _ in range(c.num_tokens)], device=device,
    )  # fmt: skip

    def logits(step: StepDeltas | None) -> torch.Tensor:
        with torch.inference_mode():
            hidden = runner.forward_tensors(dataclasses.replace(inputs, lora=step))
            return runner.flat_model.compute_logits(hidden.index_select(0, sample_index)).float()

    kernels = logits(inputs.lora)
    reference = logits(SegmentedTorchStep(registry.slots, token_slots))
    base = logits(None)
    adapted = [i for i, c in enumerate(chunks) if c.adapter]
    effect = float((kernels[adapted] - base[adapted]).abs().amax())
    error = float((kernels - reference).abs().amax())
    # bf16 rounds the two paths differently; the adapters move the logits far more than that.
    assert effect > 1.0
    assert error < 0.1 * effect, (error, effect)
    base_rows = [i for i, c in enumerate(chunks) if not c.adapter]
    torch.testing.assert_close(kernels[base_rows], base[base_rows], atol=0.1, rtol=0.05)
    runner.close()


def test_fused_model_applies_the_deltas_of_the_eager_model(kernel_device: str) -> None:
    """The fused model (q/k/v and gate/up deltas into slices of the fused outputs) with the
    kernels' step against the eager Llama model with the PyTorch path's step, float32."""
    from site_engine.engine.attention import TorchReferenceAttention
    from site_engine.engine.models.llama import LlamaFlatModel
    from site_engine.engine.models.llama_fused import LlamaFusedFlatModel

    device = torch.device(kernel_device)
    model = build_random_model(CONFIG, seed=2).to(device)
    base = BaseShapes.of_model(model)
    slots = LoraSlots(base, num_slots=3, max_rank=16, dtype=torch.float32, device=device)
    adapters = {
        name: random_adapter(name, base, rank, targets, seed)
        for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items())
        if name != "all-r12"
    }
    assigned = slots.assign(adapters, adapters.__getitem__)
    runner = ModelRunner(model, num_blocks=32, block_size=8, device=device, dtype=torch.float32,
                         attention=TorchReferenceAttention())  # fmt: skip
    rng = random.Random(9)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    chunks, block = [], 0
    for i, name in enumerate(["", *adapters, "all-r16", ""]):
        count = rng.randrange(1, 20)
        table = tuple(range(block, block + -(-count // 8)))
        block += len(table)
        tokens = tuple(rng.randrange(512) for _ in range(count))
        chunks.append(ScheduledChunk(f"c{i}", tokens, 0, table, True, greedy, 0, adapter=name))
    inputs = runner.step_tensors(runner.layout_chunks(chunks))
    token_slots = torch.tensor(
        [assigned[c.adapter] if c.adapter else -1 for c in chunks for _ in range(c.num_tokens)],
        device=device,
    )
    eager = LlamaFlatModel(model, runner.attention)
    fused = LlamaFusedFlatModel(model, runner.attention)
    args = (inputs.input_ids, inputs.positions, runner.kv_cache, inputs.metadata)
    with torch.inference_mode():
        runner.attention.prepare(inputs.metadata)
        base_hidden = eager.forward(*args)
        eager.lora = SegmentedTorchStep(slots, token_slots)
        want = eager.forward(*args)
        launches = launcher(token_slots, slots.num_slots)
        fused.lora = SegmentedLoraStep(slots, launches)
        got = fused.forward(*args)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    assert float((want - base_hidden).abs().amax()) > 0.1
