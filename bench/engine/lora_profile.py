"""Where a multi-LoRA decode step's time goes (issue 59): a decode step of 256 rows over 64
adapters (rank 16, all seven projections) of a Llama-3-8B-shaped model, against the base.

For the base engine, then the LoRA engine (64 slots) three times (`lora`: the rows over all 64
adapters, the headline; `lora_8`: over 8; `lora_no_adapter_rows`: base rows only, what rows
without an adapter cost on a LoRA engine): 256 sequences are filled until every row decodes,
then
- the mean step time over `--steps` steps (no profiler), and how many CUDA graph replays those
  steps ran (a step that replays a graph launches no kernels from the host);
- the torch profiler over `--profile-steps` steps: every GPU kernel's count and time per step,
  grouped (LoRA shrink, LoRA expand, GEMMs, attention, gathers/scatters/scans, other), and the
  host-side launches per step (cudaLaunchKernel, cudaGraphLaunch).
The JSON and MD go into --results-dir (lora_profile_<device>.*), with issue 69's keys:
`step_vs_base` {adapters: the LoRA engine's step over the base's} for 8 and 64 adapters, and
`lora_kernel_bandwidth_fraction` {adapters: fraction}: the bytes the LoRA kernels must move in a
step (bench/engine/lora_bytes.py: A and B of the adapters in use, the rows' inputs, their
outputs read and written) over the LoRA kernels' GPU time a step (the profiler's), against the
card's copy rate measured in the same run.

`--kernels-only`: the LoRA kernels alone instead, each stack against its bytes floor
(bench/engine/lora_kernel_bench.py; lora_kernels_<device>.*). Issue 77's call ran this with
`--lora-kernels segmented splitk` (an engine per kernel path) and the split-K variants; the
split-K kernels tied the segmented ones and are gone with those flags (git tag
study/lora-splitk; bench/results/engine_lora/kernel_notes_77.md).

The model is built in memory on the device (random weights, no checkpoint written), the KV cache
has a fixed 8 GiB budget (the memory trial only checks that it fits) and the flat step graphs
stop at 2,048 tokens: the whole run should take 2-3 minutes on one H100 (not yet timed there).

Device command (one GPU; here first: `bash bench/engine/lora_carry.sh`, carry `.loracarry`):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .loracarry/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD \
        FEDLLM_SHARED_DIR=$PWD/.loracarry && python3 -m bench.engine.lora_profile --results-dir $OUT

    python -m bench.engine.lora_profile --preset cpu   (the script's own smoke run; no kernels)
    python -m bench.engine.lora_profile --kernels-only   (the kernels alone)
    python -m bench.engine.lora_profile --kernels-only --preset cpu   (Triton's interpreter)
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import command_line, results_dir, write_results
from bench.engine import lora_kernel_bench
from bench.engine.harness import Progress
from bench.engine.lora_bytes import step_bytes
from bench.engine.lora_driver import (
    adapter_names,
    cancel_rest,
    fill_decoding,
    timed_steps,
    write_adapters,
)
from bench.engine.model_setup import LLAMA_8B_SHAPE
from bench.engine.paths import shared_path
from bench.engine.presets import device_label, tiny_shape
from bench.engine.roofline import measure_copy_bandwidth
from fedllm_contract.tokenizer import load_tokenizer
from site_engine.engine.lora.adapter import BaseShapes
from site_engine.engine.lora.registry import LoraSettings
from site_engine.engine.model_config import eos_token_ids
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel

PRESETS: dict[str, dict[str, Any]] = {
    "gpu": {
        "shape": {**LLAMA_8B_SHAPE, "max_position_embeddings": 4096, "rope_scaling": None},
        "device": "cuda",
        "dtype": torch.bfloat16,
        "rows": 256,
        "adapters": 64,
        "few_adapters": 8,
        "rank": 16,
        "max_num_batched_tokens": 2048,  # fewer flat-step graphs to capture than the bench's
        "kv_cache_bytes": 8 << 30,  # 256 rows of up to ~110 tokens: ~3.5 GiB at 8B
        "preset": "gpu",
    },
    "cpu": {
        "shape": tiny_shape(512),
        "device": "cpu",
        "dtype": torch.float32,
        "rows": 8,
        "adapters": 4,
        "few_adapters": 2,
        "rank": 8,
        "max_num_batched_tokens": 128,
        "kv_cache_bytes": 16 << 20,
        "preset": "cpu",
    },
}

# Kernel-name fragments of each group, first match wins (lower case).
_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("lora_shrink", ("shrink",)),
    ("lora_expand", ("expand",)),
    ("attention", ("paged", "attention", "attn", "flash", "decode_kernel")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_", "sm80_", "cublas", "matmul")),
    ("gather_scatter_scan", ("index", "gather", "scatter", "cumsum", "scan", "search", "sort")),
)


LORA_GROUPS = ("lora_shrink", "lora_expand")
COPY_BYTES = {"gpu": 1 << 30, "cpu": 64 << 20}  # the copy that measures the card's rate


def kernel_group(name: str) -> str:
    lowered = name.lower()
    return next((g for g, keys in _GROUPS if any(k in lowered for k in keys)), "other")


def random_model(p: dict[str, Any], tokenizer_dir: Path | None, seed: int) -> LoadedModel:
    """A random LlamaForCausalLM of the preset's shape built on its device in its dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_tokenizer(shared_path(tokenizer_dir, "tokenizers", "gpt2"))
    eos = int(tokenizer.eos_token_id)
    config = LlamaConfig(**p["shape"], bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(p["dtype"])
    try:
        with torch.device(p["device"]):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        max_model_len=int(config.max_position_embeddings),
        eos_token_ids=eos_token_ids(model) | {eos},
        device=torch.device(p["device"]),
        dtype=p["dtype"],
    )


@contextlib.contextmanager
def counting_replays() -> Iterator[dict[str, int]]:
    """Counts torch.cuda.CUDAGraph.replay calls while open (any graph of any engine)."""
    counts = {"replays": 0}
    original = torch.cuda.CUDAGraph.replay

    def replay(self: torch.cuda.CUDAGraph) -> None:
        counts["replays"] += 1
        original(self)

    torch.cuda.CUDAGraph.replay = replay  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        torch.cuda.CUDAGraph.replay = original  # type: ignore[method-assign]


def _device_us(event: Any) -> float:
    total = getattr(event, "device_time_total", None)
    return float(total if total is not None else event.cuda_time_total)


def profile_steps(engine: PagedEngine, steps: int, cuda: bool) -> dict[str, Any]:
    """Kernels (count, microseconds per step) and host launches per step of `steps` steps."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    kernels: list[dict[str, Any]] = []
    host: dict[str, float] = {}
    for event in prof.key_averages():
        if event.key in ("cudaLaunchKernel", "cudaGraphLaunch", "cuLaunchKernel",
                         "cuLaunchKernelEx", "cudaLaunchKernelExC"):  # fmt: skip
            host[event.key] = event.count / steps
        is_kernel = str(getattr(event, "device_type", "")).endswith("CUDA") and cuda
        if is_kernel and _device_us(event) > 0:
            kernels.append({
                "name": event.key[:120],
                "group": kernel_group(event.key),
                "per_step": event.count / steps,
                "us_per_step": _device_us(event) / steps,
            })  # fmt: skip
    kernels.sort(key=lambda k: -k["us_per_step"])
    groups: dict[str, dict[str, float]] = {}
    for k in kernels:
        g = groups.setdefault(k["group"], {"launches_per_step": 0.0, "us_per_step": 0.0})
        g["launches_per_step"] += k["per_step"]
        g["us_per_step"] += k["us_per_step"]
    return {
        "kernels": kernels,
        "groups": groups,
        "kernel_launches_per_step": sum(k["per_step"] for k in kernels),
        "gpu_us_per_step": sum(k["us_per_step"] for k in kernels),
        "host_launch_calls_per_step": host,
    }


def run_engine(
    loaded: LoadedModel,
    p: dict[str, Any],
    args: argparse.Namespace,
    lora: LoraSettings | None,
    fills: dict[str, Sequence[str | None]],
    log: Progress,
) -> dict[str, dict[str, Any]]:
    """One engine, and for each fill (a label: the rows' adapters, row i the i % len-th) the
    decode step of `rows` rows: timed, its graph replays counted, then profiled."""
    config = EngineConfig(
        max_num_seqs=p["rows"],
        max_num_batched_tokens=p["max_num_batched_tokens"],
        block_size=16,
        kv_cache_bytes=p["kv_cache_bytes"],
        prefix_caching=False,
        lora=lora,
    )
    engine = PagedEngine(loaded, config)
    log(f"engine built ({'LoRA' if lora is not None else 'base'})")
    vocab = int(loaded.model.config.vocab_size)
    budget = args.steps + args.profile_steps + 32
    cuda = loaded.device.type == "cuda"
    results: dict[str, dict[str, Any]] = {}
    for index, (label, adapters) in enumerate(fills.items()):
        seed = args.seed + index
        requests = fill_decoding(engine, vocab, p["rows"], adapters, budget, seed)
        with counting_replays() as counts:
            step_s = timed_steps(engine, args.steps)
        profile = profile_steps(engine, args.profile_steps, cuda)
        replays = counts["replays"] / args.steps
        log(f"{label}: step {step_s * 1000:.2f} ms, {replays:.1f} replays/step")
        results[label] = {
            "step_ms": step_s * 1000,
            "graph_replays_per_step": replays,
            "graphs_captured": engine._runner.num_graphs,  # the graphs it captured
            **profile,
        }
        cancel_rest(engine, requests)
    engine.close()
    if cuda:
        torch.cuda.empty_cache()
    return results


def report(result: dict[str, Any]) -> str:
    base, lora = result["base"], result["lora"]
    lines = [
        f"# LoRA decode step profile ({result['device']})",
        "",
        f"{result['rows']} decode rows over {result['adapters']} adapters of rank "
        f"{result['rank']} (all seven projections), against the base.",
        "",
        "| | base | LoRA |",
        "|---|---|---|",
        f"| step (ms) | {base['step_ms']:.2f} | {lora['step_ms']:.2f} |",
        f"| graph replays per step | {base['graph_replays_per_step']:.1f} | "
        f"{lora['graph_replays_per_step']:.1f} |",
        f"| kernels per step | {base['kernel_launches_per_step']:.0f} | "
        f"{lora['kernel_launches_per_step']:.0f} |",
        f"| GPU time per step (ms) | {base['gpu_us_per_step'] / 1000:.2f} | "
        f"{lora['gpu_us_per_step'] / 1000:.2f} |",
        f"| host launch calls per step | {base['host_launch_calls_per_step']} | "
        f"{lora['host_launch_calls_per_step']} |",
        "",
        "Step vs base by adapters in the step (`step_vs_base`): "
        + ", ".join(f"**{k}: {v:.3f}x**" for k, v in result["step_vs_base"].items())
        + "; each fill of the LoRA engine against the base: "
        + ", ".join(f"{k} {v:.3f}x" for k, v in result["steps_vs_base"].items()),
        "",
        f"LoRA kernels' bytes over their time (`lora_kernel_bandwidth_fraction`, of the "
        f"{result['copy_bytes_per_s'] / 1e12:.2f} TB/s copy rate measured in this run): "
        + ", ".join(_bandwidth_line(k, b) for k, b in result["lora_kernel_bandwidth"].items()),
        "",
        "| group | base kernels/step | base ms/step | LoRA kernels/step | LoRA ms/step |",
        "|---|---|---|---|---|",
    ]
    names = sorted(set(base["groups"]) | set(lora["groups"]))
    empty = {"launches_per_step": 0.0, "us_per_step": 0.0}
    for name in names:
        b, g = base["groups"].get(name, empty), lora["groups"].get(name, empty)
        lines.append(
            f"| {name} | {b['launches_per_step']:.0f} | {b['us_per_step'] / 1000:.3f} | "
            f"{g['launches_per_step']:.0f} | {g['us_per_step'] / 1000:.3f} |"
        )
    lines += ["", "LoRA engine, top kernels:", "", "| kernel | group | per step | us/step |",
              "|---|---|---|---|"]  # fmt: skip
    for k in lora["kernels"][:25]:
        lines.append(
            f"| `{k['name'][:90]}` | {k['group']} | {k['per_step']:.0f} | {k['us_per_step']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def kernel_bandwidth(
    arm: dict[str, Any], loaded: LoadedModel, p: dict[str, Any], adapters: int, peak: float
) -> dict[str, Any]:
    """The LoRA kernels' bytes a step (bench/engine/lora_bytes.py) over their GPU time a step
    (the profiler's lora groups), and that rate's fraction of the measured copy rate (None
    where no LoRA kernel ran: the CPU)."""
    element = torch.finfo(p["dtype"]).bits // 8
    base = BaseShapes.of_model(loaded.model)
    bytes_ = step_bytes(base, p["rank"], adapters, p["rows"], element)
    groups = arm["groups"]
    us = sum(groups.get(g, {}).get("us_per_step", 0.0) for g in LORA_GROUPS)
    rate = bytes_ / (us * 1e-6) if us > 0 else None
    return {
        "bytes_per_step": bytes_,
        "kernel_us_per_step": us,
        "bytes_per_s": rate,
        "fraction": rate / peak if rate is not None else None,
    }


def run_kernels_only(args: argparse.Namespace, argv: Sequence[str] | None, log: Progress) -> None:
    """--kernels-only: the LoRA kernels alone (bench/engine/lora_kernel_bench.py)."""
    p = PRESETS[args.preset]
    result = lora_kernel_bench.run(p)
    layers = int(p["shape"]["num_hidden_layers"])
    device = "cpu"
    if p["device"] == "cuda":
        name = torch.cuda.get_device_name(0).lower()
        device = next((gpu for gpu in ("h200", "h100", "a100", "l40s") if gpu in name), "gpu")
    path = write_results(
        f"lora_kernels_{device}",
        {"device": device, "rank": p["rank"], **result, "shape": p["shape"]},
        lora_kernel_bench.report(result, layers),
        command_line("bench.engine.lora_profile", argv),
        args.results_dir,
    )
    log(f"wrote {path}")


def _bandwidth_line(adapters: str, b: dict[str, Any]) -> str:
    if b["fraction"] is None:
        return f"{adapters}: no LoRA kernel timed"
    gb, ms = b["bytes_per_step"] / 1e9, b["kernel_us_per_step"] / 1000
    return f"**{adapters}: {b['fraction']:.2f}** ({gb:.2f} GB in {ms:.2f} ms)"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.lora_profile",
                                     description=__doc__)  # fmt: skip
    add = parser.add_argument
    add("--preset", choices=sorted(PRESETS), default="gpu" if torch.cuda.is_available() else "cpu")
    add("--tokenizer-dir", type=Path, default=None, help="default: ../shared/tokenizers/gpt2")
    add("--results-dir", type=Path, default=results_dir("engine_lora"))
    add("--steps", type=int, default=30, help="timed steps per engine")
    add("--profile-steps", type=int, default=5, help="profiled steps per engine")
    add("--seed", type=int, default=0)
    add("--kernels-only", action="store_true", help="time the LoRA kernels alone")
    args = parser.parse_args(argv)
    log = Progress()
    if args.kernels_only:
        run_kernels_only(args, argv, log)
        return
    p = PRESETS[args.preset]
    loaded = random_model(p, args.tokenizer_dir, args.seed)
    log(f"model built on {p['device']}")
    names = adapter_names(p["adapters"])
    few = p["few_adapters"]
    with tempfile.TemporaryDirectory(prefix="lora-profile-") as tmp:
        root = Path(tmp)
        distinct = min(16, p["adapters"])  # slots hold copies: the bytes need not differ
        write_adapters(root, BaseShapes.of_model(loaded.model), p["adapters"], distinct, p["rank"])
        log(f"{p['adapters']} adapters written")
        base = run_engine(loaded, p, args, None, {"base": [None]}, log)["base"]
        fills: dict[str, Sequence[str | None]] = {
            "lora": list(names),  # every adapter in the step: the headline
            f"lora_{few}": list(names[:few]),
            "lora_no_adapter_rows": [None],  # a LoRA engine's step of base rows only
        }
        settings = LoraSettings(root, p["adapters"], p["adapters"], p["rank"])
        lora = run_engine(loaded, p, args, settings, fills, log)
    peak = float(measure_copy_bandwidth(loaded.device, COPY_BYTES[p["preset"]])[
        "read_write_bytes_per_s"])  # fmt: skip
    arms = {p["adapters"]: lora["lora"], few: lora[f"lora_{few}"]}
    bandwidth = {str(n): kernel_bandwidth(arm, loaded, p, n, peak) for n, arm in arms.items()}
    device = device_label(loaded)
    result = {
        "device": device,
        "rows": p["rows"],
        "adapters": p["adapters"],
        "rank": p["rank"],
        "step_vs_base": {str(n): arm["step_ms"] / base["step_ms"] for n, arm in arms.items()},
        "lora_kernel_bandwidth_fraction": {n: b["fraction"] for n, b in bandwidth.items()},
        "lora_kernel_bandwidth": bandwidth,
        "copy_bytes_per_s": peak,
        "steps_vs_base": {label: arm["step_ms"] / base["step_ms"] for label, arm in lora.items()},
        "base": base,
        **lora,
        "shape": p["shape"],
    }
    path = write_results(
        f"lora_profile_{device}",
        result,
        report(result),
        command_line("bench.engine.lora_profile", argv),
        args.results_dir,
    )
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
