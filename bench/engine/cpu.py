"""CPU engine benchmark: iteration-level vs static (batch-by-batch) scheduling on one trace.

Both modes run the same requests (prompt and answer lengths of random Alpaca rows, replayed with
ignore_eos) through the same paged runner, only the scheduler policy differs, at MICO's maximum
batch sizes 2..10, all in one run. Also compares FCFS with shortest-predicted-first.

    python -m bench.engine.cpu            (writes bench/results/engine/engine_cpu.{json,md})
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import markdown_table, results_dir, write_results
from bench.engine.trace import TraceRequest, load_trace
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.scheduling_policy import PolicyName
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.kv_cache import KVCacheSpec, kv_cache_bytes_per_block
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.make_model import make_model_dir
from site_engine.model_loading import LoadedModel, load_model

BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024


@dataclass(frozen=True, slots=True)
class ModeResult:
    policy: str
    max_num_seqs: int
    wall_s: float
    iterations: int
    output_tokens: int
    tokens_per_s: float
    tokens_per_iteration: float
    cumulative_kv_tokens: int
    mean_completion_iterations: float
    p99_completion_iterations: float
    mean_completion_s: float


def run_mode(
    loaded: LoadedModel,
    trace: list[TraceRequest],
    max_num_seqs: int,
    policy: PolicyName,
    predictions: dict[str, int] | None = None,
) -> ModeResult:
    """All requests arrive at once; runs to the end; the cache never limits (batch size does)."""
    spec = KVCacheSpec.from_config(loaded.model.config)
    blocks_per_seq = MAX_MODEL_LEN // BLOCK_SIZE
    engine = PagedEngine(
        loaded,
        EngineConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=4096,
            block_size=BLOCK_SIZE,
            kv_cache_bytes=max_num_seqs
            * blocks_per_seq
            * kv_cache_bytes_per_block(spec, BLOCK_SIZE, loaded.dtype),
            policy=policy,
        ),
    )
    for request in trace:
        engine.add_request(
            EngineRequest(
                request.request_id,
                request.prompt_token_ids,
                SamplingParams(max_tokens=request.output_tokens, temperature=0.0, ignore_eos=True),
                predicted_tokens=(predictions or {}).get(request.request_id),
            )
        )
    done_iteration: dict[str, int] = {}
    done_seconds: dict[str, float] = {}
    cumulative_kv = iterations = produced = 0
    started = time.perf_counter()
    while engine.has_unfinished():
        outputs = engine.step()
        iterations += 1
        cumulative_kv += engine.scheduler_stats().cached_tokens
        for output in outputs:
            produced += len(output.new_token_ids)
            if output.finish_reason is not None:
                done_iteration[output.request_id] = iterations
                done_seconds[output.request_id] = time.perf_counter() - started
    wall = time.perf_counter() - started
    completion = sorted(done_iteration.values())
    return ModeResult(
        policy=policy,
        max_num_seqs=max_num_seqs,
        wall_s=wall,
        iterations=iterations,
        output_tokens=produced,
        tokens_per_s=produced / wall,
        tokens_per_iteration=produced / iterations,
        cumulative_kv_tokens=cumulative_kv,
        mean_completion_iterations=statistics.fmean(completion),
        p99_completion_iterations=completion[int(0.99 * (len(completion) - 1))],
        mean_completion_s=statistics.fmean(done_seconds.values()),
    )


def noisy(trace: list[TraceRequest], sigma: float, seed: int) -> dict[str, int]:
    """Predictions off by a log-normal factor (sigma 0 = oracle)."""
    rng = random.Random(seed)
    return {
        r.request_id: max(1, round(r.output_tokens * rng.lognormvariate(0, sigma))) for r in trace
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(range(2, 11)))
    parser.add_argument("--spf-batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--tokenizer-dir", type=Path, default=Path("../shared/tokenizers/gpt2"))
    parser.add_argument("--name", default="engine_cpu", help="result file name")
    return parser.parse_args()


def compare_batching(
    loaded: LoadedModel, trace: list[TraceRequest], sizes: list[int]
) -> dict[str, Any]:
    rows, ratios, per_size_kv = [], {}, {}
    kv_iteration = kv_static = 0
    for size in sizes:
        iteration = run_mode(loaded, trace, size, "fcfs")
        static = run_mode(loaded, trace, size, "static")
        ratios[str(size)] = iteration.tokens_per_s / static.tokens_per_s
        per_size_kv[str(size)] = 1 - iteration.cumulative_kv_tokens / static.cumulative_kv_tokens
        kv_iteration += iteration.cumulative_kv_tokens
        kv_static += static.cumulative_kv_tokens
        rows.append((iteration, static))
    return {
        "iteration_vs_static_throughput_ratio": ratios,
        "iteration_vs_static_iterations_ratio": {
            str(i.max_num_seqs): s.iterations / i.iterations for i, s in rows
        },
        "kv_cumulative_reduction": 1 - kv_iteration / kv_static,
        "kv_cumulative_reduction_by_batch_size": per_size_kv,
        "runs": [asdict(r) for pair in rows for r in pair],
    }


def compare_policies(
    loaded: LoadedModel, trace: list[TraceRequest], size: int, seed: int
) -> dict[str, Any]:
    runs = {
        "fcfs": run_mode(loaded, trace, size, "fcfs"),
        "spf_oracle": run_mode(loaded, trace, size, "spf", noisy(trace, 0.0, seed)),
        "spf_noisy_sigma0.5": run_mode(loaded, trace, size, "spf", noisy(trace, 0.5, seed)),
        "spf_noisy_sigma1.0": run_mode(loaded, trace, size, "spf", noisy(trace, 1.0, seed)),
    }
    base = runs["fcfs"].mean_completion_iterations
    return {
        "batch_size": size,
        "mean_completion_vs_fcfs": {
            k: r.mean_completion_iterations / base for k, r in runs.items()
        },
        "runs": {k: asdict(r) for k, r in runs.items()},
    }


def report(batching: dict[str, Any], policies: dict[str, Any]) -> str:
    runs = batching["runs"]
    pairs = [(runs[i], runs[i + 1]) for i in range(0, len(runs), 2)]
    table = markdown_table(
        (
            "max batch",
            "iter tok/s",
            "static tok/s",
            "throughput ratio",
            "iterations ratio",
            "KV cumulative reduction",
        ),
        [
            (
                i["max_num_seqs"],
                i["tokens_per_s"],
                s["tokens_per_s"],
                batching["iteration_vs_static_throughput_ratio"][str(i["max_num_seqs"])],
                batching["iteration_vs_static_iterations_ratio"][str(i["max_num_seqs"])],
                batching["kv_cumulative_reduction_by_batch_size"][str(i["max_num_seqs"])],
            )
            for i, s in pairs
        ],
    )
    policy_table = markdown_table(
        ("policy", "mean completion (iterations)", "p99 completion (iterations)", "vs fcfs"),
        [
            (
                name,
                r["mean_completion_iterations"],
                r["p99_completion_iterations"],
                policies["mean_completion_vs_fcfs"][name],
            )
            for name, r in policies["runs"].items()
        ],
    )
    return (
        f"## Iteration-level vs static batching\n\n{table}\n\n"
        f"KV cumulative reduction over all batch sizes: {batching['kv_cumulative_reduction']:.3f}"
        f"\n\n## FCFS vs shortest-predicted-first (max batch {policies['batch_size']})\n\n"
        f"{policy_table}\n"
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    trace = load_trace(
        "alpaca_random",
        args.requests,
        args.tokenizer_dir,
        max_total_tokens=MAX_MODEL_LEN,
        seed=args.seed,
        data_dir=args.data_dir,
    )
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(make_model_dir(Path(tmp) / "tiny-llama", "llama", args.tokenizer_dir))
    run_mode(loaded, trace[:4], 2, "fcfs")  # warm-up
    batching = compare_batching(loaded, trace, args.batch_sizes)
    policies = compare_policies(loaded, trace, args.spf_batch_size, args.seed)
    markdown = report(batching, policies)
    payload = {
        "trace": {
            "corpus": "alpaca_random",
            "requests": len(trace),
            "seed": args.seed,
            "output_tokens": sum(r.output_tokens for r in trace),
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in trace),
        },
        "model": "random llama, hidden 64, 2 layers, GPT-2 vocabulary, float32, 1 CPU thread",
        **batching,
        "policies": policies,
    }
    path = write_results(
        args.name, payload, markdown, "python -m bench.engine.cpu", results_dir("engine")
    )
    print(markdown)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
