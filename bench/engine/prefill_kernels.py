"""Attention kernels for long prompts, alone: the candidates the engine's prefill could use.

One prompt of `prompt` tokens is prefilled in chunks of `chunk` tokens, as the engine's chunked
prefill does: chunk k attends over every position before it (already in the paged cache) and
causally over its own. For each candidate this times the attention of the whole prompt (every
chunk, one layer's heads) and checks its last query rows against a float32 reference:

- triton[...]: this engine's varlen paged kernel (site_engine/engine/cuda/paged_prefill.py)
  with a tile configuration, reading K/V from a paged cache with scattered blocks;
- landed: the varlen kernel of another commit (a file given with --landed-kernel), same input;
- sdpa_flash: what transformers runs, one SDPA call over the whole prompt (contiguous K/V,
  is_causal, GQA), FlashAttention's backend forced;
- sdpa_cudnn: the same call with the cuDNN backend forced;
- fa2_varlen: per chunk, the cached prefix gathered out of the paged cache into contiguous K/V,
  then FlashAttention-2's varlen kernel (aten._flash_attention_forward, bottom-right causal);
  its time includes the gather;
- cudnn_chunked: per chunk, the context gathered likewise, then cuDNN twice (cached prefix
  unmasked, the chunk causal) merged by log-sum-exp; its time includes gather and merge;
- cudnn_paged: the engine's path for long chunks (site_engine/engine/cuda/cudnn_prefill.py):
  per chunk, one cuDNN graph call with the diagonal anchored bottom-right, reading the paged
  cache through the block table; each chunk's plan is made before the timing (the engine makes
  one per step for all its layers);
- cudnn_gathered: the same graph over the context's blocks copied out of the cache in order
  (what the engine runs by default: the paged mode is slower with 16-token blocks); its time
  includes the copy.

Attention FLOPs count each (query, visible key) pair once: 4 * head_dim * query heads per pair.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import statistics
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class HeadLayout:
    heads: int
    kv_heads: int
    head_dim: int


def chunk_plan(prompt: int, chunk: int) -> list[tuple[int, int]]:
    """(cached positions, new positions) of each chunk of a prompt prefilled `chunk` at a time."""
    return [(start, min(chunk, prompt - start)) for start in range(0, prompt, chunk)]


def attention_flops(plan: Sequence[tuple[int, int]], layout: HeadLayout) -> float:
    """Causal attention FLOPs of one layer over the plan's chunks (QK^T and PV, 2 each)."""
    pairs = sum(new * cached + new * (new + 1) // 2 for cached, new in plan)
    return 4.0 * layout.head_dim * layout.heads * pairs


@dataclass
class _Inputs:
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D] contiguous, position order
    value: torch.Tensor
    k_cache: torch.Tensor  # [blocks, block, Hkv, D], the same rows scattered
    v_cache: torch.Tensor
    slots: torch.Tensor  # [T] int64: cache slot of each position
    table: torch.Tensor  # [1, blocks] int32
    block_size: int
    expanded: tuple[torch.Tensor, torch.Tensor] | None = None


def _inputs(prompt: int, layout: HeadLayout, block_size: int, seed: int) -> _Inputs:
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(seed)
    num_blocks = -(-prompt // block_size)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)

    query = rand(prompt, layout.heads, layout.head_dim)
    key, value = (
        rand(prompt, layout.kv_heads, layout.head_dim),
        rand(prompt, layout.kv_heads, layout.head_dim),
    )
    order = torch.randperm(num_blocks + 8, generator=generator, device=device)[:num_blocks]
    shape = (num_blocks + 8, block_size, layout.kv_heads, layout.head_dim)
    k_cache = torch.zeros(shape, dtype=torch.bfloat16, device=device)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.arange(prompt, device=device)
    slots = order[positions // block_size] * block_size + positions % block_size
    k_cache.view(-1, layout.kv_heads, layout.head_dim)[slots] = key
    v_cache.view(-1, layout.kv_heads, layout.head_dim)[slots] = value
    return _Inputs(query, key, value, k_cache, v_cache, slots, order.to(torch.int32)[None],
                   block_size)  # fmt: skip


Candidate = Callable[[_Inputs, Sequence[tuple[int, int]], float], torch.Tensor]


def _paged_candidate(kernel: Callable[..., torch.Tensor], **options: Any) -> Candidate:
    def run(x: _Inputs, plan: Sequence[tuple[int, int]], scale: float) -> torch.Tensor:
        out = torch.empty_like(x.query)
        for cached, new in plan:
            q = x.query[cached : cached + new]
            starts = torch.tensor([0, new], dtype=torch.int32, device=q.device)
            lens = torch.tensor([cached + new], dtype=torch.int32, device=q.device)
            kernel(q, x.k_cache, x.v_cache, x.table, starts, lens, num_tokens=new, scale=scale,
                   out=out[cached : cached + new], **options)  # fmt: skip
        return out

    return run


def _sdpa_candidate(backend: Any, expand: bool = False) -> Candidate:
    """expand: K/V repeated to every query head beforehand (not timed), for backends that take
    no GQA."""
    from torch.nn.attention import sdpa_kernel

    def run(x: _Inputs, plan: Sequence[tuple[int, int]], scale: float) -> torch.Tensor:
        del plan  # one call over the whole prompt, as transformers' forward does
        key, value = x.key, x.value
        if expand:
            if x.expanded is None:
                group = x.query.shape[1] // key.shape[1]
                x.expanded = (key.repeat_interleave(group, 1), value.repeat_interleave(group, 1))
            key, value = x.expanded
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(
                x.query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                value.transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=not expand,
            )  # fmt: skip
        return out[0].transpose(0, 1)

    return run


def _gathered(x: _Inputs, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `context` positions' K and V copied out of the paged cache, in order
    ([context, Hkv, D]); the engine would build the slots from the block table."""
    layout = x.k_cache.shape[-2:]
    slots = x.slots[:context]
    return (x.k_cache.view(-1, *layout).index_select(0, slots),
            x.v_cache.view(-1, *layout).index_select(0, slots))  # fmt: skip


def _fa2_varlen(x: _Inputs, plan: Sequence[tuple[int, int]], scale: float) -> torch.Tensor:
    out = torch.empty_like(x.query)
    for cached, new in plan:
        context = cached + new
        k, v = _gathered(x, context)
        cu_q = torch.tensor([0, new], dtype=torch.int32, device=k.device)
        cu_k = torch.tensor([0, context], dtype=torch.int32, device=k.device)
        result = torch.ops.aten._flash_attention_forward(
            x.query[cached:context], k, v, cu_q, cu_k, new, context, 0.0, True, False,
            scale=scale,
        )  # fmt: skip
        out[cached:context] = result[0]
    return out


PrefixStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def _cudnn_per_chunk(
    x: _Inputs, plan: Sequence[tuple[int, int]], scale: float, with_prefix: PrefixStep
) -> torch.Tensor:
    """Per chunk, the context gathered out of the paged cache; a chunk with no cached prefix is
    one causal cuDNN call, the others go to `with_prefix(q, k, v, cached, scale)`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = torch.empty_like(x.query)
    for cached, new in plan:
        context = cached + new
        k, v = (part.transpose(0, 1)[None] for part in _gathered(x, context))
        q = x.query[cached:context].transpose(0, 1)[None]
        if cached == 0:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=scale, enable_gqa=True
                )
        else:
            o = with_prefix(q, k, v, cached, scale)
        out[cached:context] = o[0].transpose(0, 1)
    return out


def _cudnn_two_calls(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o_prefix, lse_prefix, o_chunk, lse_chunk): the cached prefix unmasked, the chunk itself
    causal and square, each with its log-sum-exp [B, H, Lq, 1]."""
    attend = torch.ops.aten._scaled_dot_product_cudnn_attention
    o1, lse1 = attend(q, k[:, :, :cached], v[:, :, :cached], None, True, 0.0, False, False,
                      scale=scale)[:2]  # fmt: skip
    o2, lse2 = attend(q, k[:, :, cached:], v[:, :, cached:], None, True, 0.0, True, False,
                      scale=scale)[:2]  # fmt: skip
    return o1, lse1.reshape(*o1.shape[:3], 1), o2, lse2.reshape(*o2.shape[:3], 1)


def _cudnn_chunked() -> Candidate:
    """Per chunk, cuDNN over the gathered context: the cached prefix (no mask) and the chunk
    itself (causal, square) apart, K/V repeated to every query head, merged by their
    log-sum-exps. (One causal call with fewer queries than keys is wrong here: torch's cuDNN
    path aligns the mask top-left.)"""

    def with_prefix(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int, scale: float
    ) -> torch.Tensor:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        o1, lse1, o2, lse2 = _cudnn_two_calls(q, k, v, cached, scale)
        top = torch.maximum(lse1, lse2)
        w1, w2 = (lse1 - top).exp(), (lse2 - top).exp()
        return ((o1 * w1 + o2 * w2) / (w1 + w2)).to(q.dtype)

    return functools.partial(_cudnn_per_chunk, with_prefix=with_prefix)


def _cudnn_merged(expand: bool) -> Candidate:
    """cudnn_chunked with fewer copies: the K/V heads as they are (unless `expand`: cuDNN takes
    GQA), the two parts merged by the weight sigmoid(lse_prefix - lse_chunk), in float32."""

    def with_prefix(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int, scale: float
    ) -> torch.Tensor:
        if expand:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        o1, lse1, o2, lse2 = _cudnn_two_calls(q, k, v, cached, scale)
        return torch.lerp(o2.float(), o1.float(), torch.sigmoid(lse1 - lse2)).to(q.dtype)

    return functools.partial(_cudnn_per_chunk, with_prefix=with_prefix)


def _cudnn_long(gather: bool) -> Candidate:
    from site_engine.engine.attention import AttentionMetadata
    from site_engine.engine.cuda.cudnn_prefill import CudnnLongPrefill

    long_prefill = CudnnLongPrefill.create(min_tokens=1, min_context=1, gather=gather)
    if long_prefill is None:
        raise RuntimeError("cudnn-frontend or cuDNN >= 9.7 is missing")

    plans: dict[tuple[int, int, int], Any] = {}

    def chunk_plan(x: _Inputs, cached: int, new: int) -> Any:
        """Made once per chunk, outside the timed loop: the engine makes one per step and
        shares it across its layers."""
        key = (id(x), cached, new)
        if key not in plans:
            unused = torch.empty(0, dtype=torch.int32, device=x.query.device)
            metadata = AttentionMetadata(
                slot_mapping=unused, query_start_loc=unused, context_lens=unused,
                block_tables=x.table, max_query_len=new, max_context_len=cached + new,
                query_start_loc_host=(0, new), context_lens_host=(cached + new,),
            )  # fmt: skip
            plans[key] = long_prefill.plan(metadata, x.block_size)
        return plans[key]

    def run(x: _Inputs, plan: Sequence[tuple[int, int]], scale: float) -> torch.Tensor:
        out = torch.empty_like(x.query)
        for cached, new in plan:
            rows = slice(cached, cached + new)
            done = long_prefill.run(x.query[rows], x.k_cache, x.v_cache, out[rows],
                                    chunk_plan(x, cached, new), scale=scale)  # fmt: skip
            if not done:
                raise RuntimeError("cuDNN has no plan for this chunk")
        return out

    return run


def _load_landed(path: Path) -> Callable[..., torch.Tensor]:
    spec = importlib.util.spec_from_file_location("landed_paged_prefill", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel: Callable[..., torch.Tensor] = module.paged_prefill_attention
    return kernel


def candidates(configs: Sequence[str], landed: Path | None) -> dict[str, Candidate]:
    """Every candidate by name; configs are the Triton kernel's 'BLOCK_MxTILE:warps:stages'
    (paged_prefill.parse_tiles)."""
    from torch.nn.attention import SDPBackend

    from site_engine.engine.cuda.paged_prefill import paged_prefill_attention, parse_tiles

    found: dict[str, Candidate] = {}
    for config in configs:
        tiles = parse_tiles(config)
        found[f"triton[{config}]"] = _paged_candidate(paged_prefill_attention, tiles=tiles)
    if landed is not None:
        found["landed"] = _paged_candidate(_load_landed(landed))
    found["sdpa_flash"] = _sdpa_candidate(SDPBackend.FLASH_ATTENTION)
    found["sdpa_cudnn"] = _sdpa_candidate(SDPBackend.CUDNN_ATTENTION)
    found["sdpa_cudnn_expanded"] = _sdpa_candidate(SDPBackend.CUDNN_ATTENTION, expand=True)
    found["sdpa_flash_expanded"] = _sdpa_candidate(SDPBackend.FLASH_ATTENTION, expand=True)
    found["fa2_varlen"] = _fa2_varlen
    found["cudnn_chunked"] = _cudnn_chunked()
    found["cudnn_merged"] = _cudnn_merged(expand=False)
    found["cudnn_merged_expanded"] = _cudnn_merged(expand=True)
    try:
        found["cudnn_paged"] = _cudnn_long(gather=False)
        found["cudnn_gathered"] = _cudnn_long(gather=True)
    except (ImportError, RuntimeError) as exc:
        print(f"  cudnn_paged/cudnn_gathered not measured: {exc}")
    return found


def _reference_tail(x: _Inputs, rows: int, scale: float) -> torch.Tensor:
    """float32 attention of the prompt's last `rows` queries over every position."""
    prompt, heads = x.query.shape[0], x.query.shape[1]
    group = heads // x.key.shape[1]
    q = x.query[-rows:].float().transpose(0, 1)  # [H, rows, D]
    k = x.key.float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = x.value.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * scale
    q_pos = torch.arange(prompt - rows, prompt, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(prompt, device=q.device)[None] > q_pos, -math.inf)
    return (scores.softmax(-1) @ v).transpose(0, 1)


def _time_ms(fn: Callable[[], object], reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        event = getattr(torch.cuda, "Event")  # noqa: B009 (untyped in some torch releases)
        start, end = event(enable_timing=True), event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)))
    return times


def measure(
    prompts: Sequence[int],
    chunk: int,
    layout: HeadLayout,
    configs: Sequence[str],
    *,
    landed: Path | None = None,
    reps: int = 5,
    block_size: int = 16,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """One row per (prompt, candidate): median ms, TFLOP/s and the error of its last rows."""
    scale = layout.head_dim**-0.5
    rows: list[dict[str, Any]] = []
    found = candidates(configs, landed)
    for prompt in prompts:
        plan = chunk_plan(prompt, chunk)
        flops = attention_flops(plan, layout)
        x = _inputs(prompt, layout, block_size, seed=prompt)
        reference = _reference_tail(x, 64, scale)
        for name, run in found.items():
            row: dict[str, Any] = {"prompt": prompt, "chunk": chunk, "candidate": name}
            try:
                out = run(x, plan, scale)  # compiles, and checks
                error = (out[-64:].float() - reference).norm() / reference.norm()
                row["rel_error_tail"] = float(error)
                times = _time_ms(functools.partial(run, x, plan, scale), reps)
                row["ms"] = statistics.median(times)
                row["tflops"] = flops / (row["ms"] / 1000) / 1e12
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                row["trace"] = traceback.format_exc()[-800:]
            rows.append(row)
            log(f"  attention {prompt} {name}: {row.get('ms', '-')} ms, "
                f"{row.get('tflops', 0):.0f} TFLOP/s, err {row.get('rel_error_tail', '-')}"
                f"{' ' + row['error'] if 'error' in row else ''}")  # fmt: skip
        x.expanded = None
        torch.cuda.empty_cache()
    return rows


def environment() -> dict[str, Any]:
    """What the device's torch offers for varlen attention (signatures, backends)."""
    facts: dict[str, Any] = {"cudnn": getattr(torch.backends.cudnn, "version")()}  # noqa: B009
    try:
        facts["flash_attention_forward"] = str(
            torch.ops.aten._flash_attention_forward.default._schema
        )
    except Exception as exc:
        facts["flash_attention_forward"] = repr(exc)
    try:
        from torch.nn.attention import varlen

        facts["varlen_attn"] = str(__import__("inspect").signature(varlen.varlen_attn))
    except Exception as exc:
        facts["varlen_attn"] = repr(exc)
    try:
        from torch.nn import attention

        facts["flash_impls"] = list(attention.list_flash_attention_impls())
    except Exception as exc:
        facts["flash_impls"] = repr(exc)
    return facts
