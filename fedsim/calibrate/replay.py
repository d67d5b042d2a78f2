"""The simulator against measured GPU runs: the same requests, the same engine limits, one
simulated site with the fitted step time, and the TTFT and TPOT percentiles compared.

Replayed: bench/results/engine/engine_h200.json's `engine_burst` (1,000 requests at once) and
`engine_poisson` (the same at 20 requests/s): Llama-3.2-1B-shaped on an H200, max_num_seqs 256,
budget 4,096 tokens, prefix caching on. Their trace is rebuilt exactly as the run built it
(bench/engine/workload.py: Alpaca and LIMA prompts in GPT-2 token ids, the reference answer
lengths replayed, seed 0; its Poisson arrivals), from the datasets in ../shared/datasets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.engine.workload import WorkloadSpec, load_workload, poisson_arrivals
from fedllm_contract.tokenizer import load_tokenizer
from fedsim.cards import CARDS, MODELS
from fedsim.federation import RunResult, run
from fedsim.gateway import GatewaySettings
from fedsim.site import SiteSpec
from fedsim.step_time import StepTimeModel
from fedsim.workload import SimRequest, bucket_of


@dataclass(frozen=True, slots=True)
class Replayed:
    name: str
    source: str
    measured: dict[str, float]
    simulated: dict[str, float]

    @property
    def errors(self) -> dict[str, float]:
        return {
            key: abs(self.simulated[key] - value) / value
            for key, value in self.measured.items()
            if value > 0
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "measured": self.measured,
            "simulated": self.simulated,
            "relative_error": self.errors,
        }


def _measured(summary: dict[str, Any]) -> dict[str, float]:
    return {
        "ttft_p50_s": summary["ttft"]["p50_ms"] / 1e3,
        "ttft_p99_s": summary["ttft"]["p99_ms"] / 1e3,
        "tpot_p50_s": summary["tpot"]["p50_ms"] / 1e3,
    }


def _simulated(result: RunResult) -> dict[str, float]:
    return {
        "ttft_p50_s": result.ttft_p50,
        "ttft_p99_s": result.ttft_p99,
        "tpot_p50_s": result.tpot_p50,
    }


def engine_h200(results: Path, step: StepTimeModel, shared: Path) -> list[Replayed]:
    """engine_burst and engine_poisson of engine_h200.json, replayed (the module docstring)."""
    path = results / "engine" / "engine_h200.json"
    data = json.loads(path.read_text())
    config, trace = data["config"], data["trace"]
    spec = WorkloadSpec(
        counts=tuple((corpus, count) for corpus, count in trace["by_corpus"].items()),
        max_prompt_tokens=config["max_prompt_tokens"],
        max_output_tokens=config["max_response_tokens"],
        seed=config["seed"],
    )
    tokenizer = load_tokenizer(shared / "tokenizers" / "gpt2")
    workload = load_workload(spec, tokenizer.encode, shared / "datasets")
    site = SiteSpec(
        "h200",
        CARDS["h200"],
        MODELS["llama1b"],
        step,
        rtt_s=0.0,
        max_num_seqs=config["max_num_seqs"],
        max_num_batched_tokens=config["max_num_batched_tokens"],
        block_size=config["block_size"],
        max_model_len=4096,
    )
    arrivals = {
        "engine_burst": [0.0] * len(workload),
        "engine_poisson": poisson_arrivals(len(workload), config["poisson_rate"], config["seed"]),
    }
    out = []
    for name, times in arrivals.items():
        requests = [
            SimRequest(
                w.request_id,
                at,
                w.prompt_token_ids,
                w.output_tokens,
                w.output_tokens,
                w.output_tokens,
                bucket_of(w.output_tokens),
            )
            for w, at in zip(workload, times, strict=True)
        ]
        # The engine alone: no gateway queue bound in front of it.
        settings = GatewaySettings(site_max_queued_requests=None, offload=False)
        result = run([site], requests, settings, drain_s=600.0)
        out.append(
            Replayed(
                name,
                f"{path.name}:{name}",
                _measured(data["runs"][name]["summary"]),
                _simulated(result),
            )
        )
    return out
