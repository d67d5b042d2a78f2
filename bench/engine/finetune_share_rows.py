"""Part 3 of bench.engine.finetune_share_profile: what N tokens of training sequences cost when
they ride in a decode step's forward, and what their backward costs run on its own.

The mixed forward is built here from the engine's model code, not from its runner:
`build_flat_model` over the served model (the fused Llama layers on CUDA), the engine's CUDA
paged attention kernels (without cuDNN's long-chunk path, which only takes chunks of 4,096+
tokens at 8,192+ positions: none here), and a PagedKVCache of its own holding random K/V. One
flat batch is `rows` decode rows (one token each at `decode_context` positions) followed by N
tokens of training sequences of `train_width` tokens each (from position 0), with logits for
every row (a training row's loss needs its logits). Each (rows, N) is captured as a CUDA graph,
as the engine runs a mixed step from its flat step graphs, and the replays are timed with CUDA
events, every variant once per repetition. This is the serving forward (no autograd): a step
carrying training rows must also keep their activations and run their LoRA, so the marginal
cost here is a lower bound of that step's.

The backward: the trainer's own model (finetune_share_training.TrainingStep) over the same N
tokens, as a graph of its forward with autograd on and a graph of forward + backward; the
backward is the difference, given per token and per decoder layer (the grain of a piece that
stops at layer boundaries, site_engine/finetune/pieces.py).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from bench.engine.finetune_profile import examples
from bench.engine.finetune_share_training import (
    Runnable,
    TrainingStep,
    capture,
    median,
    replayable,
    timed_ms,
)
from site_engine.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchReferenceAttention,
)
from site_engine.engine.kv_cache import PagedKVCache
from site_engine.engine.models import build_flat_model
from site_engine.finetune.trainer import LoraTrainer

BLOCK = 16


def training_lengths(tokens: int, width: int) -> list[int]:
    """N tokens as sequences of `width` (the last one shorter when N is not a multiple)."""
    full, rest = divmod(tokens, width)
    return [width] * full + ([rest] if rest else [])


def metadata(
    chunks: Sequence[tuple[int, int, Sequence[int]]], device: torch.device
) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, metadata) of a flat batch of chunks (start position, new tokens, blocks)."""
    lens = [n for _, n, _ in chunks]
    starts = list(itertools.accumulate(lens, initial=0))
    contexts = [s + n for s, n, _ in chunks]
    positions = [pos for s, n, _ in chunks for pos in range(s, s + n)]
    slots = [t[pos // BLOCK] * BLOCK + pos % BLOCK for s, n, t in chunks for pos in range(s, s + n)]
    width = max(len(t) for _, _, t in chunks)
    tables = [list(t) + [0] * (width - len(t)) for _, _, t in chunks]

    def put(values: Sequence[Any], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    meta = AttentionMetadata(
        slot_mapping=put(slots, torch.long),
        query_start_loc=put(starts, torch.int32),
        context_lens=put(contexts, torch.int32),
        block_tables=put(tables, torch.int32),
        max_query_len=max(lens),
        max_context_len=max(contexts),
        query_start_loc_host=tuple(starts),
        context_lens_host=tuple(contexts),
    )
    return put(positions, torch.long), meta


def _attention(device: torch.device) -> AttentionBackend:
    if device.type != "cuda":
        return TorchReferenceAttention()
    from site_engine.engine.cuda.attention import CudaPagedAttention

    return CudaPagedAttention(None)


def mixed_forwards(
    model: nn.Module, device: torch.device, dtype: torch.dtype, p: dict[str, Any]
) -> dict[tuple[int, int], Runnable]:
    """A run (a graph's replay on CUDA) per (decode rows, training tokens)."""
    attention = _attention(device)
    flat = build_flat_model(model, attention)
    context, width = p["decode_context"], p["train_width"]
    per_row = math.ceil(context / BLOCK)
    longest = max(p["train_tokens"])
    train_blocks = sum(math.ceil(n / BLOCK) for n in training_lengths(longest, width))
    blocks = max(p["decode_sizes"]) * per_row + train_blocks
    cache = PagedKVCache(flat.spec, num_blocks=blocks, block_size=BLOCK, dtype=dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    for layer in cache.layers:  # cached positions hold numbers, not zeros
        layer.copy_(torch.randn(layer.shape, generator=generator, device=device) * 0.5)
    vocab = int(flat.vocab_size)
    runs: dict[tuple[int, int], Runnable] = {}
    pool = None
    for rows, tokens in sorted(
        itertools.product(p["decode_sizes"], p["train_tokens"]), reverse=True
    ):
        chunks: list[tuple[int, int, Sequence[int]]] = [
            (context - 1, 1, range(r * per_row, (r + 1) * per_row)) for r in range(rows)
        ]
        first = max(p["decode_sizes"]) * per_row
        for n in training_lengths(tokens, width):
            chunks.append((0, n, range(first, first + math.ceil(n / BLOCK))))
            first += math.ceil(n / BLOCK)
        positions, meta = metadata(chunks, device)
        ids = torch.randint(0, vocab, (positions.shape[0],), device=device)

        def forward(
            ids: torch.Tensor = ids,
            positions: torch.Tensor = positions,
            meta: AttentionMetadata = meta,
        ) -> torch.Tensor:
            attention.prepare(meta)
            with torch.no_grad():
                return flat.compute_logits(flat.forward(ids, positions, cache, meta))

        runs[(rows, tokens)] = replayable(forward, device, pool)
        pool = runs[(rows, tokens)].pool() or pool
    return runs


def backward_steps(
    trainer: LoraTrainer, vocab: int, p: dict[str, Any]
) -> dict[tuple[int, str], Runnable]:
    """A run per (training tokens, "forward" | "forward_backward") on the trainer's model."""
    runs: dict[tuple[int, str], Runnable] = {}
    pool = None
    for tokens in sorted((n for n in p["train_tokens"] if n > 0), reverse=True):
        width = min(tokens, p["train_width"])
        batch = examples(tokens // width, width, vocab, seed=tokens)
        for name, backward in (("forward_backward", True), ("forward", False)):
            runs[(tokens, name)] = capture(
                TrainingStep(trainer, batch, backward=backward, optimizer=False), pool
            )
            pool = runs[(tokens, name)].pool() or pool
    return runs


def _timed_all(runs: dict[Any, Runnable], device: torch.device, reps: int) -> dict[Any, float]:
    """Each run's median ms over `reps` repetitions, all runs once per repetition (after one
    untimed repetition)."""
    times: dict[Any, list[float]] = {key: [] for key in runs}
    for rep in range(reps + 1):
        for key, run in runs.items():
            took = timed_ms(run.run, device)
            if rep:
                times[key].append(took)
    return {key: median(values) for key, values in times.items()}


def profile_rows(
    model: nn.Module,
    trainer: LoraTrainer,
    device: torch.device,
    dtype: torch.dtype,
    p: dict[str, Any],
) -> dict[str, Any]:
    layers = int(getattr(model, "config").num_hidden_layers)  # noqa: B009
    vocab = int(getattr(model, "config").vocab_size)  # noqa: B009
    forwards = mixed_forwards(model, device, dtype, p)
    forward_ms = _timed_all(forwards, device, p["reps"])
    steps = backward_steps(trainer, vocab, p)
    training_ms = _timed_all(steps, device, p["reps"])
    modes = {run.mode for run in (*forwards.values(), *steps.values())}
    mixed: dict[str, list[dict[str, Any]]] = {}
    for rows in p["decode_sizes"]:
        alone = forward_ms[(rows, 0)]
        entries = []
        for tokens in p["train_tokens"]:
            ms = forward_ms[(rows, tokens)]
            entry: dict[str, Any] = {
                "train_tokens": tokens,
                "step_ms": ms,
                "marginal_ms": ms - alone,
                "vs_decode_alone": ms / alone,
            }
            if tokens:
                entry["marginal_us_per_token"] = 1000 * (ms - alone) / tokens
                own = training_ms[(tokens, "forward")]
                both = training_ms[(tokens, "forward_backward")]
                entry["training_forward_ms"] = own
                entry["training_forward_backward_ms"] = both
                entry["backward_ms"] = both - own
                entry["backward_us_per_token"] = 1000 * (both - own) / tokens
                entry["backward_ms_per_layer"] = (both - own) / layers
            entries.append(entry)
        mixed[str(rows)] = entries
    return {
        "decode_context": p["decode_context"],
        "train_width": p["train_width"],
        "reps": p["reps"],
        "timing": "CUDA events" if device.type == "cuda" else "wall clock",
        "modes": sorted(modes),
        "by_decode_rows": mixed,
    }
