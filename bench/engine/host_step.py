"""The whole host side of an engine step at full batch, on the CPU, with fake device outputs.

A real PagedEngine (scheduler, block bookkeeping with prefix caching, model runner, sampler,
outputs, stats) runs over a tiny random Llama whose forward pass and logits are replaced by
fakes that cost almost nothing: what is timed is everything a step asks of the host besides the
device's work, at 256, 1,024 and 4,096 running sequences. Each step is `engine.step()` followed
by `engine.stats()` (the site's engine thread asks for the stats after every step), timed by the
thread's CPU time (which other load on the machine moves much less than the wall clock), and the
Python function calls of a step are counted by cProfile in a separate run (a count that load does
not move at all).

The workload keeps the running set full, with arrivals and finishes at chat rates: short prompts
(log-normal, median 60 tokens, half of them drawn with repeats from 64 shared prompts, so the
prefix cache hits), answers of log-normal length (median 250 tokens, ShareGPT-like) that end by
max_tokens (the fake logits never pick EOS), so a 1,024-sequence step sees ~4 finishes and ~4
admissions. The token budget is 8,192 a step and blocks are plentiful (no preemption).

    python -m bench.engine.host_step                       (256, 1,024, 4,096 running)
        -> bench/results/engine_overhead/host_step.{json,md}
    python -m bench.engine.host_step --name host_step_before   (the same on the code before)
    python -m bench.engine.host_step --rows 64 --steps 20 --warmup-steps 10 --out /tmp/x (smoke)

Keys: `host_cpu_ms_p50`, `host_cpu_ms_p99`, `python_calls_per_step`, each {running: value}.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import command_line, markdown_table, results_dir, write_results
from bench.engine.chat_stream import ChatStream
from bench.engine.metrics import percentile
from bench.engine.paths import shared_path
from fedllm_contract.tokenizer import load_tokenizer
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel

VOCAB = 64  # the fake model's vocabulary: its logits (fake device work) stay negligible
TOKEN = 7  # what every fake step samples (never an EOS: answers end by max_tokens)
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Settings:
    rows: tuple[int, ...] = (256, 1024, 4096)
    steps: int = 200
    warmup_steps: int = 400
    profile_steps: int = 50
    max_num_batched_tokens: int = 8192
    shared_prompts: int = 64
    repeat_fraction: float = 0.5
    seed: int = 0


class Workload:
    """An endless, seeded stream of chat requests (bench/engine/chat_stream.py)."""

    def __init__(self, settings: Settings) -> None:
        self._stream = ChatStream(settings.seed, settings.shared_prompts,
                                  settings.repeat_fraction, 1024, range(8, VOCAB))  # fmt: skip

    def next(self) -> EngineRequest:
        request_id, prompt, answer = self._stream.next()
        sampling = SamplingParams(max_tokens=answer, ignore_eos=True, temperature=0.0)
        return EngineRequest(request_id, prompt, sampling, predicted_tokens=answer)


def _fake_model(runner: Any) -> None:
    """The device's work replaced: the forward pass returns an empty hidden state and the logits
    pick TOKEN for every row (one preallocated one-hot matrix, sliced)."""
    flat = runner.flat_model
    hidden_size = int(runner.model.config.hidden_size)
    width = int(runner.vocab_size)
    rows = 8192
    onehot = torch.zeros((rows, width), dtype=torch.float32)
    onehot[:, TOKEN] = 1.0
    hidden = torch.zeros((rows, hidden_size), dtype=torch.float32)

    def forward(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden[: input_ids.shape[0]]

    def compute_logits(states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = onehot[: states.shape[0]]
        if out is not None:
            out.copy_(logits)
            return out
        return logits

    flat.forward = forward
    flat.compute_logits = compute_logits


def build_engine(running: int, settings: Settings, tokenizer_dir: Path) -> PagedEngine:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(settings.seed)
    model = LlamaForCausalLM(config).eval()
    loaded = LoadedModel(
        model=model,
        tokenizer=load_tokenizer(tokenizer_dir),
        max_model_len=4096,
        eos_token_ids=frozenset({1}),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    # Room for every running sequence at its longest (1,024 + 1,024 tokens) and the cached ones.
    blocks = running * (2048 // BLOCK_SIZE) + 4096
    per_block = 2 * config.num_hidden_layers * config.num_key_value_heads * 16 * BLOCK_SIZE * 4
    engine = PagedEngine(
        loaded,
        EngineConfig(
            max_num_seqs=running,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            block_size=BLOCK_SIZE,
            kv_cache_bytes=blocks * per_block,
            prefix_caching=True,
            model_name="host-step-bench",
            measure_step_time=False,
        ),
    )
    _fake_model(engine.runner)
    return engine


class Run:
    """One engine kept full of `running` sequences."""

    def __init__(self, running: int, settings: Settings, tokenizer_dir: Path) -> None:
        self.running = running
        self.engine = build_engine(running, settings, tokenizer_dir)
        self._workload = Workload(settings)
        self._depth = max(running // 8, 8)
        self.cpu_s: list[float] = []
        self.wall_s: list[float] = []
        self.rows: list[int] = []
        self.finished = 0

    def _top_up(self) -> None:
        waiting, _ = self.engine.queue_lengths()
        for _ in range(max(self._depth - waiting, 0)):
            self.engine.add_request(self._workload.next())

    def step(self, timed: bool) -> None:
        self._top_up()
        began, began_cpu = time.perf_counter(), time.thread_time()
        outputs = self.engine.step()
        self.engine.stats()
        ended, ended_cpu = time.perf_counter(), time.thread_time()
        if timed:
            self.cpu_s.append(ended_cpu - began_cpu)
            self.wall_s.append(ended - began)
            self.rows.append(self.engine.queue_lengths()[1])
            self.finished += sum(1 for o in outputs if o.finish_reason is not None)


def measure(running: int, settings: Settings, tokenizer_dir: Path) -> dict[str, Any]:
    run = Run(running, settings, tokenizer_dir)
    for _ in range(settings.warmup_steps):
        run.step(timed=False)
    for _ in range(settings.steps):
        run.step(timed=True)
    profiler = cProfile.Profile()
    for _ in range(settings.profile_steps):
        run._top_up()
        profiler.enable()
        run.engine.step()
        run.engine.stats()
        profiler.disable()
    stats = pstats.Stats(profiler)
    calls = stats.total_calls / settings.profile_steps  # type: ignore[attr-defined]
    run.engine.close()
    return {
        "cpu_p50_ms": percentile(run.cpu_s, 50) * 1e3,
        "cpu_p99_ms": percentile(run.cpu_s, 99) * 1e3,
        "cpu_mean_ms": statistics.fmean(run.cpu_s) * 1e3,
        "wall_p50_ms": percentile(run.wall_s, 50) * 1e3,
        "running_min": min(run.rows),
        "running_mean": statistics.fmean(run.rows),
        "finished_per_step": run.finished / settings.steps,
        "python_calls_per_step": calls,
    }


def report(result: dict[str, Any]) -> str:
    rows = []
    for running, m in result["by_running"].items():
        calls = round(m["python_calls_per_step"])
        rows.append([running, m["running_min"], m["finished_per_step"], m["cpu_p50_ms"],
                     m["cpu_p99_ms"], m["wall_p50_ms"], calls])  # fmt: skip
    table = markdown_table(
        ["running", "running (min)", "finished a step", "CPU p50 ms", "CPU p99 ms",
         "wall p50 ms", "Python calls a step"],
        rows,
    )  # fmt: skip
    p50 = result["host_cpu_ms_p50"]
    scale = ""
    if "1024" in p50 and "4096" in p50:
        scale = f"\n\n4,096 against 1,024 running: **{p50['4096'] / p50['1024']:.2f}x** CPU p50."
    return (
        "The whole host side of an engine step (`engine.step()` + `engine.stats()`) with fake "
        "device outputs: thread CPU time per step and cProfile's Python calls per step.\n\n"
        f"{table}{scale}\n"
    )


def run(settings: Settings, tokenizer_dir: Path) -> dict[str, Any]:
    by_running: dict[str, dict[str, Any]] = {}
    for running in settings.rows:
        print(f"  {running} running ...", flush=True)
        by_running[str(running)] = measure(running, settings, tokenizer_dir)
    return {
        "settings": asdict(settings),
        "by_running": by_running,
        "host_cpu_ms_p50": {k: v["cpu_p50_ms"] for k, v in by_running.items()},
        "host_cpu_ms_p99": {k: v["cpu_p99_ms"] for k, v in by_running.items()},
        "python_calls_per_step": {k: v["python_calls_per_step"] for k, v in by_running.items()},
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.host_step", description=__doc__)
    defaults = Settings()
    parser.add_argument("--rows", type=int, nargs="+", default=list(defaults.rows))
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument("--profile-steps", type=int, default=defaults.profile_steps)
    parser.add_argument("--tokenizer-dir", type=Path, default=None)
    parser.add_argument("--name", default="host_step")
    parser.add_argument("--out", type=Path, default=results_dir("engine_overhead"))
    args = parser.parse_args(argv)
    settings = Settings(
        rows=tuple(args.rows),
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        profile_steps=args.profile_steps,
    )
    tokenizer_dir = shared_path(args.tokenizer_dir, "tokenizers", "gpt2")
    torch.set_num_threads(1)
    result = run(settings, tokenizer_dir)
    markdown = report(result)
    write_results(args.name, result, markdown, command_line("bench.engine.host_step", argv),
                  args.out)  # fmt: skip
    print(markdown)


if __name__ == "__main__":
    main()
