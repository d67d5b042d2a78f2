"""The long-context mix of the serving benchmark: prompt and answer lengths of real traces.

Half of the requests take their (prompt, answer) lengths from Azure's 2023 conversation trace
(one hour of a production chat service: prompts median ~1,000 tokens, p99 ~4,100), half from
Mooncake's FAST'25 synthetic trace (multi-turn conversations built from public datasets: prompts
mean ~15,000 tokens, p90 ~38,600), each prompt capped so that prompt + answer fit the model's
context. The traces carry no text: token ids are random, so no two prompts share a prefix (a
prefix cache gains nothing on this mix; what it measures is long prefill next to decoding).
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path

from bench.loadgen.traces import read_trace
from fedsim.engine_trace import WorkloadRequest

AZURE_CONV = "azure_llm_inference_2023_conv.csv"
MOONCAKE_SYNTHETIC = "mooncake_fast25_synthetic_trace.jsonl"


@dataclass(frozen=True, slots=True)
class TraceLengths:
    azure: tuple[tuple[int, int], ...]  # (prompt tokens, answer tokens) per request
    mooncake: tuple[tuple[int, int], ...]


def load_trace_lengths(traces_dir: Path) -> TraceLengths:
    with (traces_dir / AZURE_CONV).open(newline="") as handle:
        azure = tuple(
            (int(row["ContextTokens"]), int(row["GeneratedTokens"]))
            for row in csv.DictReader(handle)
        )
    mooncake = read_trace(traces_dir / MOONCAKE_SYNTHETIC)
    return TraceLengths(azure, tuple((r.input_length, r.output_length) for r in mooncake))


def fit_to_context(prompt: int, answer: int, context: int) -> tuple[int, int, bool]:
    """(prompt, answer, prompt was cut): the answer kept (at least 1 token, at most half the
    context), the prompt cut so that both fit."""
    answer = max(1, min(answer, context // 2))
    room = context - answer
    return max(1, min(prompt, room)), answer, prompt > room


def build_trace_mix(
    lengths: TraceLengths, count: int, seed: int, *, vocab: int, context: int
) -> list[WorkloadRequest]:
    """`count` requests, alternately from the Azure and the Mooncake lengths (drawn uniformly,
    with replacement, by a seeded generator)."""
    rng = random.Random(f"longctx-{seed}")
    requests = []
    for i in range(count):
        source, pool = ("azure_conv", lengths.azure) if i % 2 == 0 else (
            "mooncake_synthetic", lengths.mooncake)  # fmt: skip
        index = rng.randrange(len(pool))
        prompt, answer, cut = fit_to_context(*pool[index], context)
        requests.append(
            WorkloadRequest(
                request_id=f"longctx-{seed}-{i}",
                corpus=source,
                record_index=index,
                prompt_token_ids=tuple(rng.randrange(vocab) for _ in range(prompt)),
                output_tokens=answer,
                reference_output_tokens=pool[index][1],
                prompt_truncated=cut,
            )
        )
    return requests
