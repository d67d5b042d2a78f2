"""Quick decode-step probe on the GPU: the per-step time of engine.step() at a few batch sizes
for a Llama-3.2-1B-shaped random model, with and without CUDA graphs. For the full sweep against
the roofline use bench/engine/gpu.py; for where a step's time goes, bench/engine/step_profile.py.

    python -m bench.engine.decode_probe [--batch-sizes 1 64 256]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

from fedllm_contract.tokenizer import load_tokenizer
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.make_model import build_random_model
from site_engine.model_loading import load_model

LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


def build(out: Path, tokenizer_dir: Path) -> Path:
    model = build_random_model(LlamaConfig(**LLAMA_1B), seed=0).to(torch.bfloat16)
    model.save_pretrained(str(out))
    load_tokenizer(tokenizer_dir).save_pretrained(str(out))
    return out


def decode_steps(engine: PagedEngine, batch: int, prompt: int, steps: int) -> list[float]:
    for i in range(batch):
        engine.add_request(
            EngineRequest(
                f"b{batch}-{i}",
                tuple(range(1000, 1000 + prompt)),
                SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True),
            )
        )
    while engine.scheduler_stats().num_waiting:
        engine.step()
    engine.step()  # first all-decode step
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1000)
    while engine.has_unfinished():
        engine.step()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer-dir", type=Path, default=Path("../shared/tokenizers/gpt2"))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(
            build(Path(tmp) / "llama1b", args.tokenizer_dir), device="cuda", dtype="bfloat16"
        )
    for graphs in (False, True):
        engine = PagedEngine(
            loaded,
            EngineConfig(
                max_num_seqs=max(args.batch_sizes), kv_cache_bytes=16 << 30, cuda_graphs=graphs
            ),
        )
        for batch in args.batch_sizes:
            times = decode_steps(engine, batch, args.prompt, args.steps)
            print(
                f"graphs={graphs} batch={batch} step_ms p50={statistics.median(times):.3f} "
                f"min={min(times):.3f}",
                flush=True,
            )
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
