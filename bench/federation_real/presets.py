"""What `python -m bench.federation_real` runs: the sites (model shape, batch limits, one-way
delay, device), the load, the SLO and the arms.

- `cpu`: two tiny random Llamas on this machine's CPU, unequal by batch limits (8 and 2 slots),
  5 and 50 ms one way, lengths scaled to a sixteenth: the CI smoke run
  (tests/bench/test_federation_real_smoke.py). Only the shape of its result means anything.
- `gpu`: one site per GPU of the machine (`--gpus N`, default every visible one), alternating
  Llama-3.2-1B and Llama-3.1-8B shapes (random bf16 weights, bench/engine/model_setup.py), so
  the sites are unequal by model; one-way delays spread evenly over 5-150 ms (the 8B site
  nearest). ShareGPT-like lengths at full size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.engine.model_setup import LLAMA_1B_SHAPE, LLAMA_8B_8K_SHAPE, SMALL_SHAPE
from fedsim.federation import Slo

# The tiny CPU shape: bench.loadgen.models.TINY's sizes with the 1B shape's layout.
TINY_SHAPE: dict[str, Any] = {
    **SMALL_SHAPE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "head_dim": 16,
    "max_position_embeddings": 1024,
}
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": TINY_SHAPE,
    "llama1b": LLAMA_1B_SHAPE,
    "llama8b": LLAMA_8B_8K_SHAPE,
}
ARMS = ("completion_cost", "least_requests", "round_robin")


@dataclass(frozen=True, slots=True)
class SiteSetup:
    """One site: its model shape (a SHAPES key, also fedsim's model name), where it runs (`gpu`:
    the index CUDA_VISIBLE_DEVICES shows it; None on the CPU), its batch limits and its one-way
    delay from the gateway."""

    name: str
    shape: str
    one_way_ms: float
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu: int | None = None
    kv_cache_mib: int | None = None

    @property
    def context(self) -> int:
        return int(SHAPES[self.shape]["max_position_embeddings"])

    def engine_args(self, dtype: str) -> list[str]:
        device = "cpu" if self.gpu is None else "cuda"
        args = ["--device", device, "--dtype", dtype, "--max-num-seqs", str(self.max_num_seqs)]
        args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.kv_cache_mib is not None:
            args += ["--kv-cache-mib", str(self.kv_cache_mib)]
        if self.gpu is not None:  # every graph captured before READY: none mid-run, in any arm
            args.append("--no-lazy-graphs")
        return args


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    sites: tuple[SiteSetup, ...]
    dtype: str
    rate_rps: float
    duration_s: float
    drain_s: float
    slo: Slo
    # Every prompt and answer length x this (CPU scale), then capped.
    length_scale: float
    max_prompt_tokens: int
    max_answer_tokens: int
    # A trace's prefix block (512 tokens in the Mooncake trace) at this scale.
    block_tokens: int
    arms: tuple[str, ...] = ARMS

    @property
    def device(self) -> str:
        return "cpu" if all(s.gpu is None for s in self.sites) else "cuda"


def _spread(n: int, low: float = 5.0, high: float = 150.0) -> list[float]:
    return [low + (high - low) * i / max(n - 1, 1) for i in range(n)]


def gpu_sites(count: int) -> tuple[SiteSetup, ...]:
    """One site a GPU: the 8B shape on even GPUs, the 1B on odd ones; delays 5-150 ms one way,
    the 8B sites nearest (the fast site far: routing must weigh speed against distance)."""
    if count < 1:
        raise ValueError("the gpu preset needs at least one GPU")
    delays = _spread(count)
    sites = []
    for gpu in range(count):
        big = gpu % 2 == 0
        sites.append(
            SiteSetup(
                f"site{gpu}-{'8b' if big else '1b'}",
                "llama8b" if big else "llama1b",
                delays[gpu],
                max_num_seqs=16 if big else 32,
                max_num_batched_tokens=2048,
                gpu=gpu,
            )
        )
    return tuple(sites)


CPU = Preset(
    name="cpu",
    sites=(
        SiteSetup("site-a", "tiny", 5.0, 8, 256, kv_cache_mib=4),
        SiteSetup("site-b", "tiny", 50.0, 2, 256, kv_cache_mib=4),
    ),
    dtype="float32",
    rate_rps=3.0,
    duration_s=6.0,
    drain_s=20.0,
    slo=Slo(ttft_p99_s=5.0, tpot_p99_s=0.5),
    length_scale=1 / 16,
    max_prompt_tokens=128,
    max_answer_tokens=64,
    block_tokens=32,
    arms=("completion_cost", "round_robin"),
)


def gpu_preset(count: int) -> Preset:
    return Preset(
        name="gpu",
        sites=gpu_sites(count),
        dtype="bfloat16",
        rate_rps=0.0,  # set by rate_for
        # 25 s of arrivals an arm and at most 20 s of drain: three arms, the models' builds and
        # the sites' starts fit one device call of ~5 minutes.
        duration_s=25.0,
        drain_s=20.0,
        slo=Slo(),
        length_scale=1.0,
        max_prompt_tokens=2048,
        max_answer_tokens=1024,
        block_tokens=512,
    )


# The GPU preset's offered load per pair of sites (an 8B and a 1B), by card: chosen on fedsim
# (the preset's sites and workload, seed 0, 25 s, the grid-fitted step models with the admitting
# host term) as a rate that round robin and least_requests no longer serve at the SLO and
# completion_cost still does. H100, 40 req/s: goodput completion_cost 40.0 req/s (p99 SLO met),
# least_requests 37.3, round robin 33.0 (at 30 s on the models before: 40.0 / 36.9 / 32.9; at
# 30 req/s every arm served all). H200, 55 req/s: 55.0 / 50.5 / 43.5 (at 50, 30 s, the models
# before: 50.0 / 49.2 / 47.5, too close).
PAIR_RATES = {"h100": 40.0, "h200": 55.0}


def rate_for(preset: Preset, card: str) -> float:
    """The GPU preset's offered load on `card` (PAIR_RATES, per two sites)."""
    if card not in PAIR_RATES:
        raise ValueError(f"no offered load chosen for {card!r}: give --rate")
    return PAIR_RATES[card] * len(preset.sites) / 2


def choose(name: str, gpus: int | None) -> Preset:
    """The preset (the GPU one without its rate: rate_for, once the card is known)."""
    if name == "cpu":
        return CPU
    if name != "gpu":
        raise ValueError(f"unknown preset {name!r}: cpu or gpu")
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    return gpu_preset(gpus)
