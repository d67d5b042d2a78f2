"""The same requests through two engines, token by token: the before and after of an engine
change that must not change what it answers (issue 66).

One random Llama (tiny, float32, CPU, one thread) serves a workload chosen to exercise what the
host path handles row by row: prompts sharing prefixes (prefix-cache hits), a token budget
smaller than most prompts (chunked prefill), a KV cache too small for every running sequence
(recompute preemption), arrivals while others run, and cancellations (running and queued). Every
request's tokens under this checkout's engine are compared with the same request's tokens under
`--baseline-engine` (another commit's site_engine/engine, run in bench.engine.baseline_engine's
hybrid tree in a subprocess on the same model directory).

    python -m bench.engine.tokens_before_after --baseline-engine DIR
        -> bench/results/engine_overhead/tokens_before_after.{json,md}

DIR: e.g. `git archive cac8a4f site_engine/engine | tar x -C /tmp/base` then
`/tmp/base/site_engine/engine`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import command_line, markdown_table, results_dir, write_results
from bench.engine.model_setup import SMALL_SHAPE, build_model_dir
from bench.engine.paths import shared_path
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.kv_cache import KVCacheSpec, kv_cache_bytes_per_block
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import load_model

BLOCK_SIZE = 4


def workload(seed: int, count: int, vocab: int) -> list[EngineRequest]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(8, 40))] for _ in range(5)]
    requests = []
    for i in range(count):
        prefix = rng.choice(prefixes) if rng.random() < 0.6 else []
        suffix = [rng.randrange(vocab) for _ in range(rng.randint(2, 60))]
        requests.append(
            EngineRequest(
                request_id=f"r{i}",
                prompt_token_ids=tuple(prefix + suffix),
                sampling=SamplingParams(
                    max_tokens=rng.randint(4, 48), temperature=0.0, ignore_eos=True
                ),
                # Under-predicted answers: admission plans short, real ones outgrow the cache.
                predicted_tokens=rng.randint(1, 8),
            )
        )
    return requests


def serve(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """This process's engine over the workload: {request id: tokens} and what it went through."""
    torch.set_num_threads(1)
    loaded = load_model(model_dir, device="cpu", dtype="float32")
    per_block = kv_cache_bytes_per_block(
        KVCacheSpec.from_config(loaded.model.config), BLOCK_SIZE, loaded.dtype
    )
    engine = PagedEngine(
        loaded,
        EngineConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            block_size=BLOCK_SIZE,
            kv_cache_bytes=args.num_blocks * per_block,
            prefix_caching=True,
            model_name="tokens-before-after",
        ),
    )
    rng = random.Random(args.seed + 1)
    pending = workload(args.seed, args.requests, loaded.vocab_size)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in pending}
    finished: dict[str, str] = {}
    cancelled: list[str] = []
    steps = 0
    for request in pending[: args.max_num_seqs]:
        engine.add_request(request)
    queue = pending[args.max_num_seqs :]
    while engine.has_unfinished() or queue:
        if queue and steps % 2 == 0:
            engine.add_request(queue.pop(0))
        if steps % 37 == 5:  # a cancellation every so often, running or queued
            live = [r for r in tokens if r not in finished and r not in cancelled]
            added = {r.request_id for r in queue}
            choices = [r for r in live if r not in added]
            if choices:
                victim = rng.choice(choices)
                engine.abort(victim, FinishReason.CANCELLED)
                cancelled.append(victim)
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
            if output.finish_reason is not None:
                finished[output.request_id] = str(output.finish_reason)
        steps += 1
    stats = engine.stats()
    engine.close()
    return {
        "tokens": tokens,
        "finished": finished,
        "cancelled": cancelled,
        "steps": steps,
        "preemptions": stats.num_preemptions,
        "prefix_cache_hits": stats.prefix_cache_hits,
    }


def compare(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    both = sorted(set(after["finished"]) & set(before["finished"]))
    differ = [r for r in both if after["tokens"][r] != before["tokens"][r]]
    return {
        "finished_both": len(both),
        "finished_only_after": sorted(set(after["finished"]) - set(before["finished"])),
        "finished_only_before": sorted(set(before["finished"]) - set(after["finished"])),
        "differ": differ,
        "identical": len(both) - len(differ),
        "tokens_compared": sum(len(after["tokens"][r]) for r in both),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine.tokens_before_after", description=__doc__
    )
    add = parser.add_argument
    add("--baseline-engine", type=Path, default=None)
    add("--requests", type=int, default=96)
    add("--max-num-seqs", type=int, default=8)
    add("--max-num-batched-tokens", type=int, default=24)
    add("--num-blocks", type=int, default=64, help="256 token slots: preemption")
    add("--seed", type=int, default=0)
    add("--model-dir", type=Path, default=None)
    add("--tokenizer-dir", type=Path, default=None)
    add("--serve-only", type=Path, default=None, help="write this engine's run here and stop")
    add("--results-dir", type=Path, default=results_dir("engine_overhead"))
    add("--name", default="tokens_before_after")
    return parser.parse_args(argv)


def baseline_run(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    from bench.engine.baseline_engine import hybrid_tree

    with tempfile.TemporaryDirectory(prefix="fedllm-tokens-") as tmp:
        root = Path(tmp)
        tree = hybrid_tree(args.baseline_engine.resolve(), root / "tree")
        out = root / "before.json"
        command = [
            sys.executable, "-m", "bench.engine.tokens_before_after", "--model-dir",
            str(model_dir), "--serve-only", str(out), "--requests", str(args.requests),
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
            str(args.max_num_batched_tokens), "--num-blocks", str(args.num_blocks),
            "--seed", str(args.seed),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run(command, cwd=tree, env=env, check=True)
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fedllm-tokens-model-") as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            shape = {**SMALL_SHAPE, "max_position_embeddings": 512}
            tokenizer_dir = shared_path(args.tokenizer_dir, "tokenizers", "gpt2")
            model_dir, _ = build_model_dir(
                Path(tmp) / "model", shape, tokenizer_dir, torch.float32, args.seed, "cpu"
            )
        after = serve(model_dir, args)
        if args.serve_only is not None:
            args.serve_only.write_text(json.dumps(after))
            return 0
        if args.baseline_engine is None:
            raise SystemExit("--baseline-engine DIR is needed to compare (or --serve-only)")
        before = baseline_run(args, model_dir)
    result = compare(after, before)
    payload = {
        "baseline_engine": str(args.baseline_engine),
        "settings": {k: v for k, v in vars(args).items() if isinstance(v, int | str)},
        "after": {k: after[k] for k in ("steps", "preemptions", "prefix_cache_hits")},
        "before": {k: before[k] for k in ("steps", "preemptions", "prefix_cache_hits")},
        "cancelled": after["cancelled"],
        **result,
    }
    table = markdown_table(
        ["", "steps", "preemptions", "prefix-cache hit tokens"],
        [["before", before["steps"], before["preemptions"], before["prefix_cache_hits"]],
         ["after", after["steps"], after["preemptions"], after["prefix_cache_hits"]]],
    )  # fmt: skip
    summary = (
        f"{result['identical']} of {result['finished_both']} requests finished by both engines "
        f"carry identical tokens ({result['tokens_compared']} tokens); differ: "
        f"{result['differ'] or 'none'}; finished only after: "
        f"{result['finished_only_after'] or 'none'}, only before: "
        f"{result['finished_only_before'] or 'none'}."
    )
    command = command_line("bench.engine.tokens_before_after", argv)
    write_results(args.name, payload, f"{summary}\n\n{table}\n", command, args.results_dir)
    print(summary)
    return 0 if not result["differ"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
