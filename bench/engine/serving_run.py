"""What the serving benchmark's phases share (`Run`): arguments, clock, deadline, prompt pools
and the payload written so far. A module of its own so that the phases' modules
(bench.engine.serving, serving_cache) and the report (serving_report) import it and not each
other: serving -> serving_run, serving_cache, serving_report; serving_cache -> serving_run;
serving_run -> serving_report; serving_report -> none of them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.engine.harness import Deadline, Progress
from bench.engine.open_loop import Slo
from bench.engine.paths import resolve_data_dir, shared_path
from bench.engine.report import versions
from bench.engine.serving_report import save
from bench.engine.serving_traces import TraceLengths, build_trace_mix, load_trace_lengths
from bench.engine.serving_workload import PromptPools, build_mix, load_pools
from fedllm_contract.tokenizer import load_tokenizer
from fedsim.engine_trace import WorkloadRequest


class Run:
    """What the phases share: arguments, clock, deadline and the payload written so far."""

    def __init__(self, args: argparse.Namespace, command: str) -> None:
        self.args, self.command = args, command
        self.log = Progress()
        self.deadline = Deadline(self.log, args.deadline_s)
        self.phases = set(args.phases.split(","))
        self.tokenizer_dir = shared_path(args.tokenizer_dir, "tokenizers", "gpt2")
        self.data_dir = resolve_data_dir(args.data_dir)
        self.traces_dir = shared_path(args.traces_dir, "datasets", "traces").resolve()
        self.payload: dict[str, Any] = {
            "complete": False,
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "versions": versions(),
            "errors": {},
        }
        self._pools: PromptPools | None = None
        self._traces: TraceLengths | None = None
        self.context = 0  # the model's max length, set once it is loaded
        self.slo = Slo(ttft_p99_ms=args.slo_ttft_ms, tpot_p99_ms=args.slo_tpot_ms)

    def requests(self, mix: str, count: int, seed: int) -> list[WorkloadRequest]:
        """`count` requests of a swept mix."""
        if mix != "longctx":
            return build_mix(self.pools(), mix, count, seed)  # type: ignore[arg-type]
        if self._traces is None:
            self._traces = load_trace_lengths(self.traces_dir)
        context = 64 if self.args.small else self.context
        if self.args.context_cap:
            context = min(context, self.args.context_cap)
        return build_trace_mix(self._traces, count, seed, vocab=self.pools().vocab,
                               context=context)  # fmt: skip

    def pools(self) -> PromptPools:
        """The encoded prompt pools, loaded once (the sweeps and transformers share them)."""
        if self._pools is None:
            tokenizer = load_tokenizer(self.tokenizer_dir)
            small = self.args.small
            self._pools = load_pools(tokenizer.encode, len(tokenizer), self.data_dir,
                                     max_prompt_tokens=48 if small else 3072,
                                     max_answer_tokens=8 if small else 1024)  # fmt: skip
        return self._pools

    def save(self, phase: str) -> None:
        path = save(self.args, self.payload, self.command)
        self.log(f"{phase} done (results so far in {path})")

    def time_left(self, reserve_s: float = 0.0) -> float:
        return self.deadline.budget(float("inf"), reserve_after=reserve_s)
