"""What `python -m bench.federation_real` runs: the sites (model shape, batch limits, one-way
delay, device), the load, the SLO and the arms.

- `cpu`: two tiny random Llamas on this machine's CPU, unequal by batch limits (8 and 2 slots),
  5 and 50 ms one way, lengths scaled to a sixteenth, a fixed 3 req/s: the CI smoke run
  (tests/bench/test_federation_real_smoke.py). Only the shape of its result means anything.
- `gpu`: one site per GPU of the machine (`--gpus N`, default every visible one), alternating
  Llama-3.2-1B and Llama-3.1-8B shapes (random bf16 weights, bench/engine/model_setup.py), so
  the sites are unequal by model; one-way delays spread evenly over 5-150 ms (the 8B site
  nearest). Sites at the sizes operators run (issue 78): the 8B at 256 sequences, the 1B at
  1,024, both at 8,192 batched tokens a step, the shapes the engine benches run them at
  (bench/engine/lora.py's gpu preset: the 8B at 256 / 8,192; bench/results/engine/
  host_bound_h200.md: the 1B at 1,024 / 8,192, 7.5 ms a full decode step). ShareGPT-like lengths
  at full size; the offered loads are 0.7x and 1.1x the pair's capacity, measured through the
  gateway before the arms (bench/federation_real/capacity.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
# The gpu preset's batch limits (module docstring): sequences by shape, batched tokens a step.
DEPLOYED_SEQS = {"llama8b": 256, "llama1b": 1024}
DEPLOYED_BATCHED_TOKENS = 8192


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
class CapacityPlan:
    """The saturation phase before the arms (capacity.py): closed-loop streams started over
    `ramp_s`, each sending its next request when its last one ended, counted in `windows`
    windows of `window_s` from `settle_s` (the queues full by then), cut at the last one's end.
    `streams` None: every site's slots plus (sites - 1/2) x the gateway's per-site queue bound,
    so that every site's batch is full whichever site routing favours and none is refused.
    `requests_per_stream`: built for each stream, more than it can send before the stop (a
    stream that runs dry stops early, and the load with it)."""

    ramp_s: float = 4.0
    settle_s: float = 8.0
    window_s: float = 4.0
    windows: int = 3
    streams: int | None = None
    # GPU: a stream's turn takes its queue wait (~1 s with the queues full) and its answer
    # (~4 s at the mean): ~5 turns in 20 s, more if its answers are short.
    requests_per_stream: int = 10

    @property
    def stop_s(self) -> float:
        return self.settle_s + self.window_s * self.windows


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
    # Offered loads as multiples of the measured capacity (none: `rate_rps` itself).
    loads: tuple[float, ...] = ()
    capacity: CapacityPlan = CapacityPlan()
    # Processes sending the requests (bench/serving_path/clients.py: a client loop of its own
    # each, so that no client's lag shows as a first token's).
    clients: int = 2

    @property
    def device(self) -> str:
        return "cpu" if all(s.gpu is None for s in self.sites) else "cuda"


def _spread(n: int, low: float = 5.0, high: float = 150.0) -> list[float]:
    return [low + (high - low) * i / max(n - 1, 1) for i in range(n)]


def parse_layout(text: str) -> tuple[tuple[str, float], ...]:
    """`--gpu-sites`' value, e.g. "llama1b@150" or "llama8b@5,llama1b@150": one site a GPU, in
    GPU order, each a shape the preset deploys and its one-way delay in ms."""
    layout = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        shape, _, delay = item.partition("@")
        try:
            one_way_ms = float(delay)
        except ValueError:
            one_way_ms = math.nan
        if shape not in DEPLOYED_SEQS or not one_way_ms >= 0:
            shapes = sorted(DEPLOYED_SEQS)
            raise ValueError(f"a GPU site is SHAPE@MS, SHAPE in {shapes}, MS >= 0: {item!r}")
        layout.append((shape, one_way_ms))
    if not layout:
        raise ValueError("a GPU site layout names no site")
    return tuple(layout)


def gpu_sites(
    count: int, layout: Sequence[tuple[str, float]] | None = None
) -> tuple[SiteSetup, ...]:
    """One site a GPU: the 8B shape on even GPUs, the 1B on odd ones, each at its deployed batch
    limits; delays 5-150 ms one way, the 8B sites nearest (the fast site far: routing must
    weigh speed against distance). `layout` (parse_layout) sets each GPU's shape and delay
    instead: the 1B site alone at its 150 ms on one GPU, say (issue 78: the one site whose
    answers lagged its steps)."""
    if layout is None:
        if count < 1:
            raise ValueError("the gpu preset needs at least one GPU")
        delays = _spread(count)
        layout = [("llama8b" if gpu % 2 == 0 else "llama1b", delays[gpu]) for gpu in range(count)]
    sites = []
    for gpu, (shape, delay) in enumerate(layout):
        big = shape == "llama8b"
        sites.append(
            SiteSetup(
                f"site{gpu}-{'8b' if big else '1b'}",
                shape,
                delay,
                max_num_seqs=DEPLOYED_SEQS[shape],
                max_num_batched_tokens=DEPLOYED_BATCHED_TOKENS,
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
    # With --loads only: a closed loop the 2-core machine can drive.
    capacity=CapacityPlan(
        ramp_s=1.0, settle_s=3.0, window_s=2.0, windows=3, streams=24, requests_per_stream=80
    ),
)


def gpu_preset(count: int, layout: Sequence[tuple[str, float]] | None = None) -> Preset:
    return Preset(
        name="gpu",
        sites=gpu_sites(count, layout),
        dtype="bfloat16",
        rate_rps=0.0,  # from `loads` and the measured capacity (or --rate)
        # 25 s of arrivals a cell (issue 78's floor) and at most 20 s of drain: a 1,024-token
        # answer at ~15 ms a step takes ~15 s, so one that arrives last still finishes.
        duration_s=25.0,
        drain_s=20.0,
        slo=Slo(),
        length_scale=1.0,
        max_prompt_tokens=2048,
        max_answer_tokens=1024,
        block_tokens=512,
        loads=(0.7, 1.1),
        # ~300 requests a second at 1.1x: eight client loops of ~40 each.
        clients=8,
    )


def choose(
    name: str, gpus: int | None, layout: Sequence[tuple[str, float]] | None = None
) -> Preset:
    """The preset (the GPU one without a rate: its loads scale the measured capacity)."""
    if name == "cpu":
        return CPU
    if name != "gpu":
        raise ValueError(f"unknown preset {name!r}: cpu or gpu")
    if layout is not None:
        return gpu_preset(len(layout), layout)
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    return gpu_preset(gpus)
