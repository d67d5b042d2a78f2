"""The federations the benchmark builds: unequal sites on purpose.

Every site serves the same routing model name with the same tokenizer, but sites differ in
batch slots (--max-num-seqs), KV budget (--kv-cache-mib), model size (one site serves a bigger,
slower model of the same family: a region with older GPUs, say) and round trip to the gateway
(5, 40, 80 and 150 ms RTT with jitter, through the latency injector). Capacity weights are what
an operator would configure for `mico`: batch slots times the model's relative speed (the
ratio of the two models' parameters, an estimate the benchmark does not tune).

Models are random weights saved with `save_pretrained` and loaded through the normal path
(no pretrained weights can be fetched here): the answers are replayed with `ignore_eos`, so
only their lengths matter. On the GPU the shapes are SmolLM2's 135M and 360M.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from transformers import LlamaConfig

from bench.federation.prefix_workloads import Shape
from fedllm_contract.tokenizer import CHATML_TEMPLATE, load_tokenizer
from site_engine.make_model import build_random_model

ROUTED_MODEL = "fed"


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    context: int

    def parameters(self, vocab: int) -> int:
        """Roughly: embeddings (tied) + per layer attention and MLP."""
        head_dim = self.hidden // self.heads
        attention = self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return vocab * self.hidden + self.layers * (attention + mlp)

    def config(self, vocab: int, eos: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.context,
            tie_word_embeddings=True,
            eos_token_id=eos,
            bos_token_id=eos,
        )


@dataclass(frozen=True, slots=True)
class SiteSpec:
    name: str
    shape: str  # a ModelShape name
    max_num_seqs: int
    kv_cache_mib: int
    rtt_ms: float
    jitter_ms: float
    device: str = "cpu"
    dtype: str = "float32"

    def args(self) -> list[str]:
        return [
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--kv-cache-mib",
            str(self.kv_cache_mib),
            "--device",
            self.device,
            "--dtype",
            self.dtype,
        ]


@dataclass(frozen=True, slots=True)
class PrefixRuns:
    """How the prefix-reuse workloads run on a preset (bench/federation/prefix_workloads.py):
    the shape of their prompts, the coarse rates per workload before the knee is bisected,
    arrivals and drain per run, and the sites' host-memory tier (when the engine has one)."""

    shape: Shape
    rates: dict[str, tuple[float, ...]]
    duration_s: float
    drain_s: float
    bisections: int = 2
    host_kv_gib: float = 0.0
    calibration_tokens: int = 2048


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    shapes: tuple[ModelShape, ...]
    sites: tuple[SiteSpec, ...]
    rates: tuple[float, ...]  # requests per second swept
    duration_s: float  # arrivals per rate
    drain_s: float  # after the last arrival, how long answers may still take
    answer_scale: float  # answers are replayed at this share of their length
    max_prompt_tokens: int
    max_answer_tokens: int
    prefix: PrefixRuns | None = None

    def shape(self, name: str) -> ModelShape:
        return next(shape for shape in self.shapes if shape.name == name)

    def capacity_weights(self, vocab: int) -> dict[str, float]:
        """Batch slots x relative model speed (inverse parameter count, smallest model = 1)."""
        smallest = min(shape.parameters(vocab) for shape in self.shapes)
        return {
            site.name: round(
                site.max_num_seqs * smallest / self.shape(site.shape).parameters(vocab), 3
            )
            for site in self.sites
        }


_RTTS = (5.0, 40.0, 80.0, 150.0)
_JITTER_SHARE = 0.1  # jitter up to a tenth of the RTT

# CPU: tiny models so that four sites, the gateway and the injector share two cores.
_TINY = ModelShape("tiny", 64, 2, 4, 2, 128, 1024)
_SLOW = ModelShape("tiny-slow", 256, 4, 4, 2, 512, 1024)
# GPU: SmolLM2-135M's shape, and SmolLM2-360M's for the slow region (decode is bound by
# reading the weights: ~2.7x the bytes, ~2.5x slower a step; small enough to build in seconds).
_SMOL_135M = ModelShape("smollm2-135m", 576, 30, 9, 3, 1536, 8192)
_SMOL_360M = ModelShape("smollm2-360m", 960, 32, 15, 5, 2560, 8192)


def _site(i: int, shape: str, seqs: int, kv_mib: int, device: str, dtype: str) -> SiteSpec:
    rtt = _RTTS[i % len(_RTTS)]
    return SiteSpec(f"site-{i + 1}", shape, seqs, kv_mib, rtt, rtt * _JITTER_SHARE, device, dtype)


def _gpu_sites(devices: Sequence[str]) -> tuple[SiteSpec, ...]:
    """Four sites; on one GPU each takes a share of its memory. KV budgets (bf16; 135M: 23 KB a
    token, 360M: 40 KB): ~91k, ~22k, ~45k and ~38k tokens, so the 32-slot site and the slow one
    run out of KV before they run out of slots on long prompts."""
    d = [devices[i % len(devices)] for i in range(4)]
    return (
        _site(0, _SMOL_135M.name, 64, 2048, d[0], "bfloat16"),
        _site(1, _SMOL_135M.name, 32, 512, d[1], "bfloat16"),
        _site(2, _SMOL_135M.name, 16, 1024, d[2], "bfloat16"),
        _site(3, _SMOL_360M.name, 32, 1536, d[3], "bfloat16"),
    )


PRESETS: dict[str, Preset] = {
    "cpu": Preset(
        name="cpu",
        shapes=(_TINY, _SLOW),
        # KV (float32; tiny: 512 B a token, slow: 4 KiB): 4,096, 2,048, 2,048, 2,048 tokens.
        sites=(
            _site(0, _TINY.name, 8, 2, "cpu", "float32"),
            _site(1, _TINY.name, 4, 1, "cpu", "float32"),
            _site(2, _TINY.name, 2, 1, "cpu", "float32"),
            _site(3, _SLOW.name, 6, 8, "cpu", "float32"),
        ),
        rates=(4.0, 8.0, 12.0, 16.0),
        duration_s=20.0,
        drain_s=30.0,
        answer_scale=0.125,
        max_prompt_tokens=512,
        max_answer_tokens=256,
        # Tiny contexts (1,024): a trace block id stands for 16 tokens, not 512 (every input
        # scaled alike), the system prompt is 256 tokens, answers an eighth of their length.
        prefix=PrefixRuns(
            shape=Shape(16, 960, 64, 0.125, 256),
            rates={
                "trace": (6.0, 16.0, 32.0),
                "shared_prefix": (4.0, 12.0, 24.0),
                "sharegpt": (4.0, 8.0, 12.0),
                "text": (4.0, 8.0, 12.0),
            },
            duration_s=15.0,
            drain_s=20.0,
            calibration_tokens=256,
        ),
    ),
    "h200": Preset(
        name="h200",
        shapes=(_SMOL_135M, _SMOL_360M),
        sites=_gpu_sites(("cuda:0",)),
        rates=(12.0, 18.0, 24.0, 30.0),
        duration_s=12.0,
        # A 1,024-token answer at ~12 ms a token outlasts a 12 s drain (the first H200 run).
        drain_s=30.0,
        answer_scale=1.0,
        max_prompt_tokens=3072,
        max_answer_tokens=1024,
        # A trace block id is 512 tokens as in the trace, prompts are cut at the context less
        # the longest answer (8,192 - 1,024), the system prompt is 4,096 tokens. One device
        # call per workload of at most ~9.5 minutes: ~2.5 min to start 4 sites, 7 gateways and
        # SGLang's router, then 8 arms x at most 5 rates (3 coarse, 2 bisected) of 5 s of
        # arrivals and at most 6 s of drain.
        prefix=PrefixRuns(
            shape=Shape(512, 7168, 1024, 1.0, 4096),
            rates={
                "trace": (3.0, 6.0, 12.0),
                "shared_prefix": (4.0, 10.0, 24.0),
                "sharegpt": (8.0, 16.0, 32.0),
                "text": (8.0, 16.0, 32.0),
            },
            duration_s=5.0,
            drain_s=6.0,
            host_kv_gib=4.0,
        ),
    ),
}

# Four GPUs: the same sites, one a GPU.
PRESETS["h200x4"] = replace(
    PRESETS["h200"], name="h200x4", sites=_gpu_sites(("cuda:0", "cuda:1", "cuda:2", "cuda:3"))
)
# One H100 (about 78 GiB): the same four sites sharing it.
PRESETS["h100"] = replace(PRESETS["h200"], name="h100")
# Two GPUs (nvidia-h100-x2): the same sites, alternating GPUs (the lora workload's two sites,
# the first two, one a GPU).
PRESETS["h100x2"] = replace(PRESETS["h200"], name="h100x2", sites=_gpu_sites(("cuda:0", "cuda:1")))


def write_model(out: Path, shape: ModelShape, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random model of `shape` with the tokenizer, saved like a real model directory
    (reused when it is there already)."""
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    tokenizer = load_tokenizer(tokenizer_dir)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else len(tokenizer) - 1
    model = build_random_model(shape.config(len(tokenizer), int(eos)), seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(str(out))
    return out
