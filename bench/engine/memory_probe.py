"""Where a GPU engine's memory goes at start-up, piece by piece.

    python -m bench.engine.memory_probe --model-dir DIR \
        [--max-num-seqs 1024 --max-num-batched-tokens 8192]

Loads the model, then builds the runner's parts one at a time and records after each the
memory torch has allocated and reserved, its peak, and what the device reports in use (the
difference to torch's reservation is memory torch does not manage: the CUDA context, cuBLAS
workspaces, instantiated CUDA graphs): the KV cache, the largest step run eagerly, the sampler
on max_num_seqs rows (temperature and top-p: its most memory-hungry path), the decode graphs
and the flat step graphs. The numbers are what the engine's memory plan must account for.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from site_engine.engine.core.types import SamplingParams, ScheduledChunk, SchedulerOutput
from site_engine.engine.kv_cache import KVCacheSpec, kv_cache_bytes_per_block
from site_engine.engine.model_runner import ModelRunner
from site_engine.model_loading import load_model

MIB = 1 << 20


def snapshot(device: torch.device, label: str, rows: list[dict[str, Any]]) -> None:
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    row = {
        "stage": label,
        "allocated_mib": torch.cuda.memory_allocated(device) / MIB,
        "reserved_mib": torch.cuda.memory_reserved(device) / MIB,
        "peak_allocated_mib": torch.cuda.max_memory_allocated(device) / MIB,
        "device_used_mib": (total - free) / MIB,
        "not_torch_mib": (total - free - torch.cuda.memory_reserved(device)) / MIB,
    }
    rows.append(row)
    print(json.dumps(row), flush=True)
    torch.cuda.reset_peak_memory_stats(device)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.memory_probe")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-gib", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    rows: list[dict[str, Any]] = []
    snapshot(device, "start", rows)
    loaded = load_model(args.model_dir, device="cuda", dtype="bfloat16")
    snapshot(device, "model loaded", rows)
    spec = KVCacheSpec.from_config(loaded.model.config)
    per_block = kv_cache_bytes_per_block(spec, 16, loaded.dtype)
    blocks = int(args.kv_gib * (1 << 30)) // per_block
    runner = ModelRunner(loaded.model, num_blocks=blocks, block_size=16, device=device,
                         dtype=loaded.dtype)  # fmt: skip
    snapshot(device, f"runner without graphs, KV {args.kv_gib} GiB", rows)
    tokens = args.max_num_batched_tokens
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    table = tuple(range(-(-tokens // 16)))
    step = SchedulerOutput(chunks=(ScheduledChunk("probe", tuple([1] * tokens), 0, table, True,
                                                  greedy, 0),))  # fmt: skip
    runner.execute(step)
    snapshot(device, f"largest step eagerly ({tokens} tokens)", rows)
    sampled = SamplingParams(max_tokens=1, temperature=0.7, top_p=0.9)
    chunks = [ScheduledChunk(f"s{i}", (1,), 0, (0,), True, sampled, 0)
              for i in range(args.max_num_seqs)]  # fmt: skip
    logits = torch.randn(args.max_num_seqs, loaded.vocab_size, device=device)
    runner.sampler.sample_tensor(logits, chunks)
    del logits
    snapshot(device, f"sampler, {args.max_num_seqs} rows, temperature + top-p", rows)
    torch.cuda.empty_cache()
    snapshot(device, "after empty_cache", rows)
    from site_engine.engine.cuda.graphs import DecodeGraphs
    from site_engine.engine.cuda.step_graphs import FlatStepGraphs

    max_blocks = -(-loaded.max_model_len // 16)
    decode = DecodeGraphs(runner.flat_model, runner.attention, runner.kv_cache,
                          max_batch=args.max_num_seqs, max_blocks_per_seq=max_blocks,
                          scratch_block=blocks - 1)  # fmt: skip
    decode.capture()
    snapshot(device, f"decode graphs captured ({len(decode.buckets)} buckets)", rows)
    flat = FlatStepGraphs(runner.flat_model, runner.attention, runner.kv_cache,
                          max_tokens=tokens, max_seqs=args.max_num_seqs,
                          max_blocks_per_seq=max_blocks, scratch_block=blocks - 1)  # fmt: skip
    flat.capture()
    snapshot(device, f"flat step graphs captured ({len(flat.buckets)} buckets)", rows)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
