"""The `lora` workload (issue 51): many tenants' LoRA adapters over one base, two sites.

Every request names one adapter (the OpenAI `model` field), drawn with Zipf(s) popularity over
`adapters` of them (adapter k of rank 1 is asked with weight 1 / k^s): a few hot tenants and a
long tail, as multi-LoRA serving papers (S-LoRA, dLoRA) and vLLM's benchmarks model it. Each
site keeps `slots` adapters in device slots and `cpu_loras` in host memory; the rest are read
from disk on demand (site_engine/engine/lora/registry.py). A router blind to where the adapters
are spreads each adapter over both sites, so each site must hold (and churn through) nearly
every adapter; one that knows keeps each adapter's requests on the site that holds it.

Prompts are random token ids of log-normal lengths and answers log-normal lengths replayed with
`ignore_eos` (max_tokens = the length): every arm plans with the true lengths (no predictor in
this workload), so what differs between arms is where the adapters are, not length prediction.
Adapters are random PEFT adapters of the base's shape (one directory both sites serve).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from bench.federation.workload import Request
from site_engine.engine.lora.adapter import BaseShapes

_MLP = ("gate_proj", "up_proj", "down_proj")
_PEFT_PREFIX = "base_model.model.model.layers"
_Z99 = 2.3263478740408408


@dataclass(frozen=True, slots=True)
class LoraRuns:
    """How the lora workload runs on a preset."""

    adapters: int
    slots: int  # --max-loras: adapters in device slots per site
    cpu_loras: int  # --max-cpu-loras: adapters in host memory per site
    rank: int
    targets: tuple[str, ...]
    rates: tuple[float, ...]
    duration_s: float
    drain_s: float
    prompt_median: int
    prompt_p99: int
    answer_median: int
    answer_p99: int
    zipf_s: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.slots <= self.cpu_loras or self.adapters < 1:
            raise ValueError("need adapters >= 1 and 1 <= slots <= cpu_loras")
        if not self.rates or min(self.rates) <= 0 or self.duration_s <= 0:
            raise ValueError("rates and duration must be > 0")

    def site_args(self, lora_dir: Path) -> tuple[str, ...]:
        return (
            "--lora-dir", str(lora_dir), "--max-loras", str(self.slots),
            "--max-cpu-loras", str(self.cpu_loras), "--max-lora-rank", str(self.rank),
        )  # fmt: skip


ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# CPU: tiny models on two shared cores; few adapters and slots so that the sites churn anyway.
CPU_RUNS = LoraRuns(
    adapters=24, slots=2, cpu_loras=4, rank=8, targets=("q_proj", "v_proj"),
    rates=(3.0, 6.0), duration_s=10.0, drain_s=20.0,
    prompt_median=64, prompt_p99=256, answer_median=16, answer_p99=64,
)  # fmt: skip
# GPU (issue 51): 200 adapters, 32 device slots a site, rank 16 on all seven projections.
GPU_RUNS = LoraRuns(
    adapters=200, slots=32, cpu_loras=64, rank=16, targets=ALL_PROJECTIONS,
    rates=(8.0, 16.0, 24.0, 32.0), duration_s=12.0, drain_s=20.0,
    prompt_median=256, prompt_p99=2048, answer_median=128, answer_p99=512,
)  # fmt: skip


def adapter_names(count: int) -> tuple[str, ...]:
    return tuple(f"tenant-{k:03d}" for k in range(count))


def write_adapters(directory: Path, model_dir: Path, runs: LoraRuns, seed: int = 0) -> Path:
    """`runs.adapters` random PEFT adapters of the model's shape under `directory` (kept when
    they are there already: writing 200 takes a while on a big base)."""
    names = adapter_names(runs.adapters)
    if all((directory / name / "adapter_config.json").is_file() for name in names):
        return directory
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    base = BaseShapes.of_model(model)
    del model
    for k, name in enumerate(names):
        _write_adapter(directory / name, base, runs, seed * 100_003 + k)
    return directory


def _write_adapter(path: Path, base: BaseShapes, runs: LoraRuns, seed: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(base.num_layers):
        for proj in runs.targets:
            in_f, out_f = base.features[proj]
            key = f"{_PEFT_PREFIX}.{layer}.{'mlp' if proj in _MLP else 'self_attn'}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(runs.rank, in_f, generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, runs.rank, generator=gen) * 0.01
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": runs.rank, "lora_alpha": 2 * runs.rank,
              "target_modules": list(runs.targets), "bias": "none"}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))


def _lognormal(rng: random.Random, median: int, p99: int) -> int:
    sigma = math.log(p99 / median) / _Z99
    return max(1, min(p99, round(rng.lognormvariate(math.log(median), sigma))))


def zipf_weights(count: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(count)]


def lora_arrivals(runs: LoraRuns, rate_rps: float, seed: int, vocab: int) -> list[Request]:
    """Poisson arrivals at `rate_rps` for runs.duration_s, each for an adapter drawn by Zipf
    popularity (the adapters' ranks shuffled by the seed, so tenant-000 is not always the hot
    one); the same (rate, seed) gives the same requests at the same offsets."""
    rng = random.Random(f"lora-{seed}-{rate_rps}")
    names = list(adapter_names(runs.adapters))
    random.Random(f"lora-popularity-{seed}").shuffle(names)
    weights = zipf_weights(len(names), runs.zipf_s)
    requests: list[Request] = []
    at = rng.expovariate(rate_rps)
    while at < runs.duration_s:
        adapter = rng.choices(names, weights)[0]
        length = _lognormal(rng, runs.prompt_median, runs.prompt_p99)
        prompt = tuple(rng.randrange(vocab) for _ in range(length))
        answer = _lognormal(rng, runs.answer_median, runs.answer_p99)
        i = len(requests)
        requests.append(
            Request(f"l{seed}-{rate_rps:g}-{i}", "lora_zipf", prompt, answer, at, model=adapter)
        )
        at += rng.expovariate(rate_rps)
    return requests


def adapter_spread(requests: Sequence[Request]) -> dict[str, float]:
    """How concentrated the workload is: distinct adapters asked, and the hottest one's share."""
    counts: dict[str, int] = {}
    for request in requests:
        counts[request.model or ""] = counts.get(request.model or "", 0) + 1
    top = max(counts.values(), default=0)
    return {"distinct_adapters": len(counts), "top_share": round(top / max(len(requests), 1), 3)}
