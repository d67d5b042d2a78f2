"""What one prediction costs when the predictor's weights are no longer in the CPU's caches.

    python -m bench.predictor.cold_cache --predictor DIR [--repeats 300] [--evict-mib 64]

A gateway serving one request at a time runs ~2 ms of other work (HTTP, tokenizing, gRPC, the
request log) between two predictions, and the other core runs the clients and sites: the
predictor's int8 weights (~5 MB for 3 MiniLM layers) leave the caches in between. This measures
one short prompt, one thread (as the gateway runs it), back to back ("warm") and after reading a
buffer larger than the last-level cache before each call ("cold"), alternating the two modes in
rounds so that a change of the host's speed hits both. Writes
bench/results/predictor/predictor_cold_cache.*.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import markdown_table, results_dir, write_results
from predictor.runtime import LengthPredictor

PROMPTS = ("Say hello.", "Write a haiku about the sea.", "What is the capital of France?")


def _timed_ms(predictor: LengthPredictor, prompt: str, evict: np.ndarray | None) -> float:
    if evict is not None:
        evict.sum()  # reads every cache line of a buffer larger than the last-level cache
    started = time.perf_counter()
    predictor.predict_batch([prompt])
    return (time.perf_counter() - started) * 1000.0


def measure(artifact: Path, repeats: int, evict_mib: int, rounds: int = 6) -> dict[str, object]:
    predictor = LengthPredictor.load(artifact, threads=1)
    evict = np.ones(evict_mib * 1024 * 1024 // 8)
    for prompt in PROMPTS * 10:  # the first calls allocate and pick kernels
        predictor.predict_batch([prompt])
    samples: dict[str, list[float]] = {"warm": [], "cold": []}
    per_round = max(1, repeats // rounds)
    for round_index in range(rounds):
        order = ("warm", "cold") if round_index % 2 == 0 else ("cold", "warm")
        for mode in order:
            for i in range(per_round):
                prompt = PROMPTS[i % len(PROMPTS)]
                buffer = evict if mode == "cold" else None
                samples[mode].append(_timed_ms(predictor, prompt, buffer))
    summary = {
        mode: {
            "p50_ms": float(np.percentile(values, 50)),
            "p90_ms": float(np.percentile(values, 90)),
            "n": len(values),
        }
        for mode, values in samples.items()
    }
    return {
        "artifact": str(artifact),
        "evict_mib": evict_mib,
        "prompts": list(PROMPTS),
        "modes": summary,
        "cold_over_warm_p50": summary["cold"]["p50_ms"] / summary["warm"]["p50_ms"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.predictor.cold_cache")
    parser.add_argument("--predictor", type=Path, required=True, help="a predictor artifact")
    parser.add_argument("--repeats", type=int, default=300, help="calls per mode")
    parser.add_argument("--evict-mib", type=int, default=64, help="buffer read before cold calls")
    args = parser.parse_args(argv)
    result = measure(args.predictor.resolve(), args.repeats, args.evict_mib)
    modes = result["modes"]
    assert isinstance(modes, dict)
    rows = [[mode, v["p50_ms"], v["p90_ms"], v["n"]] for mode, v in modes.items()]
    table = markdown_table(["weights", "p50 ms", "p90 ms", "calls"], rows)
    ratio = f"Cold over warm (p50): {result['cold_over_warm_p50']:.2f}x."
    given = sys.argv[1:] if argv is None else argv
    command = "python -m bench.predictor.cold_cache " + " ".join(given)
    write_results(
        "predictor_cold_cache", result, f"{table}\n\n{ratio}\n", command, results_dir("predictor")
    )
    print(table, ratio, sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
