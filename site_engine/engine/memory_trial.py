"""The memory trial a CUDA engine runs before it sizes its KV cache (memory_plan.py plans).

The trial builds the real model runner with a KV cache just large enough for the largest step
and the largest CUDA graph of each kind (decode: max_num_seqs rows; flat step: max_num_batched
tokens), then runs what the engine will run at its largest: a prefill step of
max_num_batched_tokens tokens, a decode step of max_num_seqs rows, and the sampler on those rows
with temperature, top-p and seeds (its most memory-hungry path). The peak of the memory torch
reserved over the trial, less the trial's own cache, is what the engine needs besides weights
and KV cache; the smaller graphs share the largest one's pool. The trial's runner is then freed
and the free memory read: whatever stays loaded (kernels, cuBLAS workspaces, compiled code) is
counted there, so an engine built after another one gets the same cache.
"""

from __future__ import annotations

import gc

import torch

from site_engine.engine.attention import TorchReferenceAttention
from site_engine.engine.core.types import SamplingParams, ScheduledChunk
from site_engine.engine.graphs.decode_graphs import bucket_sizes
from site_engine.engine.graphs.flat_step_graphs import token_buckets
from site_engine.engine.memory_plan import GRAPH_BYTES_PER_LAYER, TrialMeasurement, blocks_for
from site_engine.engine.model_runner import ModelRunner
from site_engine.engine.models import build_flat_model
from site_engine.model_loading import LoadedModel

# Sampling that allocates the most temporaries per row (softmax, top-p sort, seeded noise).
_HUNGRY = SamplingParams(max_tokens=2, temperature=0.7, top_p=0.9, ignore_eos=True)
_HUNGRY_SEEDED = SamplingParams(max_tokens=2, temperature=0.7, top_p=0.9, seed=1, ignore_eos=True)


def graph_counts(
    max_num_seqs: int, max_num_batched_tokens: int, cuda_graphs: bool
) -> tuple[int, int]:
    """(graphs of every layer: decode steps and flat-step bodies, lm_head graphs of the flat
    steps) that a runner with these limits captures."""
    if not cuda_graphs:
        return 0, 0
    decode = len(bucket_sizes(max_num_seqs))
    if max_num_batched_tokens < 2:
        return decode, 0
    heads = len(bucket_sizes(min(max_num_seqs, max_num_batched_tokens)))
    return decode + len(token_buckets(max_num_batched_tokens)), heads


def graph_count(max_num_seqs: int, max_num_batched_tokens: int, cuda_graphs: bool) -> int:
    """How many CUDA graphs a runner with these limits captures."""
    return sum(graph_counts(max_num_seqs, max_num_batched_tokens, cuda_graphs))


def release_unreachable(device: torch.device) -> None:
    """Collects what nothing references any more (an engine dropped without close(), caught in
    a reference cycle) and returns cached blocks to the device."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


@torch.inference_mode()
def run_trial(
    loaded: LoadedModel,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int,
    cuda_graphs: bool,
) -> TrialMeasurement:
    device = loaded.device
    # The flat model fuses the model's projections once (models/fused.py); done here first so
    # that the unfused weights it frees are not counted in the trial's peak, and so that a
    # first engine and a second one measure the same thing.
    build_flat_model(loaded.model, TorchReferenceAttention())
    release_unreachable(device)
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    tokens = min(max_num_batched_tokens, loaded.max_model_len)
    blocks = blocks_for(tokens, block_size) + 1
    runner = ModelRunner(
        loaded.model,
        num_blocks=blocks,
        block_size=block_size,
        device=device,
        dtype=loaded.dtype,
        cuda_graph_max_batch=max_num_seqs if cuda_graphs else 0,
        cuda_graph_max_tokens=max_num_batched_tokens if cuda_graphs else 0,
        only_largest_graphs=True,
        max_rows=max_num_seqs,
    )
    trial_cache = runner.kv_cache.num_bytes
    table = tuple(range(blocks_for(tokens, block_size)))
    prefill = ScheduledChunk("trial-prefill", (0,) * tokens, 0, table, True, _HUNGRY, 0)
    runner.execute_chunks((prefill,))
    # Every row decodes position 1 of block 0: what the rows read does not change the memory.
    rows = tuple(
        ScheduledChunk(f"trial-{i}", (0,), 1, (0,), True, _HUNGRY_SEEDED if i % 2 else _HUNGRY, 1)
        for i in range(max_num_seqs)
    )
    runner.execute_chunks(rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device)
    runner.close()
    del runner, prefill, rows
    release_unreachable(device)
    free, total = torch.cuda.mem_get_info(device)
    layers = int(loaded.model.config.num_hidden_layers)
    layered, heads = graph_counts(max_num_seqs, max_num_batched_tokens, cuda_graphs)
    return TrialMeasurement(
        total=int(total),
        free=int(free),
        weights=int(weights),
        step_and_sampler=max(0, int(peak - torch.cuda.memory_reserved(device) - trial_cache)),
        # An lm_head graph's few nodes are counted as one layer's.
        graph_driver=(layered * layers + heads) * GRAPH_BYTES_PER_LAYER,
        graphs=layered + heads,
    )
