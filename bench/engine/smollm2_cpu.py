"""The engine on the real model, on the CPU: SmolLM2-135M-Instruct answering the same chat
prompts through our PagedEngine (iteration-level batching) and through transformers `generate`
in static batches (left-padded, each batch running until its longest answer ends), one run.

    python -m bench.engine.smollm2_cpu [--requests 32] [--max-tokens 128] [--batch 8]

Answers end at the model's own EOS (greedy, no ignore_eos): a static batch keeps computing rows
that have finished until the batch's longest answer is done, which is the work continuous
batching saves. Useful tokens are each answer's own tokens (up to and including its EOS); both
sides answer the same prompts with the same greedy decoding, so they produce the same tokens.
Writes bench/results/engine/engine_smollm2_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import markdown_table, results_dir, write_results
from predictor.datasets import load_corpus
from predictor.label_served import render_prompt
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.gguf_import import materialize
from site_engine.model_loading import LoadedModel, load_model

CORPORA = ("alpaca_random", "dolly", "gsm8k")


def workload(
    loaded: LoadedModel, count: int, seed: int, data_dir: Path | None
) -> list[tuple[int, ...]]:
    records = [r for c in CORPORA for r in load_corpus(c, data_dir)]  # type: ignore[arg-type]
    picked = random.Random(seed).sample(records, count)
    return [render_prompt(loaded, r.prompt) for r in picked]


def run_engine(
    loaded: LoadedModel, prompts: list[tuple[int, ...]], max_tokens: int, batch: int
) -> dict[str, Any]:
    engine = PagedEngine(loaded, EngineConfig(max_num_seqs=batch, max_num_batched_tokens=2048))
    outputs: dict[str, list[int]] = {}
    started = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", ids, SamplingParams(max_tokens, temperature=0)))
        outputs[f"r{i}"] = []
    steps = 0
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id].extend(output.new_token_ids)
        steps += 1
    wall = time.perf_counter() - started
    useful = sum(len(v) for v in outputs.values())
    return {
        "wall_s": wall,
        "useful_tokens": useful,
        "useful_tok_s": useful / wall,
        "steps": steps,
        "answers": [outputs[f"r{i}"] for i in range(len(prompts))],
    }


def run_generate(
    loaded: LoadedModel, prompts: list[tuple[int, ...]], max_tokens: int, batch: int
) -> dict[str, Any]:
    model = loaded.model
    pad = int(loaded.tokenizer.pad_token_id or 0)
    eos = sorted(loaded.eos_token_ids)
    answers: list[list[int]] = []
    computed = 0
    started = time.perf_counter()
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_tokens,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        new = out[:, width:]
        computed += new.numel()
        for row in new.tolist():
            answer: list[int] = []
            for token in row:
                answer.append(token)
                if token in loaded.eos_token_ids:
                    break
            answers.append(answer)
    wall = time.perf_counter() - started
    useful = sum(len(a) for a in answers)
    return {
        "wall_s": wall,
        "useful_tokens": useful,
        "useful_tok_s": useful / wall,
        "computed_tokens": computed,
        "answers": answers,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine.smollm2_cpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", type=Path, help="GGUF or model dir (default: bundled SmolLM2)")
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from devtools.demo import bundled_gguf

        args.model = bundled_gguf()
    loaded = load_model(materialize(args.model) if args.model.suffix == ".gguf" else args.model)
    prompts = workload(loaded, args.requests, args.seed, args.data_dir)
    run_engine(loaded, prompts[:2], 8, args.batch)  # warm-up: first-call allocations
    engine = run_engine(loaded, prompts, args.max_tokens, args.batch)
    hf = run_generate(loaded, prompts, args.max_tokens, args.batch)
    same = sum(a == b for a, b in zip(engine.pop("answers"), hf.pop("answers"), strict=True))
    ratio = engine["useful_tok_s"] / hf["useful_tok_s"]
    payload = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "engine": engine,
        "generate_static": hf,
        "throughput_ratio": ratio,
        "identical_answers": same,
        "requests": len(prompts),
    }
    table = markdown_table(
        ["runner", "useful tokens", "tokens computed", "wall s", "useful tok/s"],
        [
            [
                "PagedEngine (iteration-level)",
                engine["useful_tokens"],
                engine["useful_tokens"],
                engine["wall_s"],
                engine["useful_tok_s"],
            ],
            [
                f"transformers generate, static batches of {args.batch}",
                hf["useful_tokens"],
                hf["computed_tokens"],
                hf["wall_s"],
                hf["useful_tok_s"],
            ],
        ],
    )
    markdown = (
        f"{table}\n\nEngine / generate: **{ratio:.2f}x** useful tok/s; identical greedy "
        f"answers: {same}/{len(prompts)} (float32, {args.threads} threads, one run)."
    )
    command = "python -m bench.engine.smollm2_cpu " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    write_results("engine_smollm2_cpu", payload, markdown, command.strip(), results_dir("engine"))
    print(markdown)


if __name__ == "__main__":
    main()
