"""A short GPU profile of the site's LoRA trainer against a standalone peft loop (issue 60): a
few training units on the Llama-3-8B shape at 1x256, 4x256 and 8x512 tokens a step, each unit's
time, the CUDA memory it peaked at against site_engine/finetune/memory.py's estimate, and a torch
profiler kernel table of the trainer's units (launches per unit and the share of the wall clock
the GPU was busy say whether a unit is launch-bound).

    python -m bench.engine.finetune_profile            (GPU, one card, under 3 minutes)
    python -m bench.engine.finetune_profile --cpu-smoke (a tiny model on the CPU: the wiring)

The model is a seeded random LlamaForCausalLM built in memory on the card in bf16 with SDPA (no
tokenizer, nothing written to disk): the figures are of the shape, not of trained weights. Each
step of either loop is one whole batch of `rows` examples of `width` tokens (loss on the last
three quarters of each): the site's trainer (LoraTrainer.work with a budget of the whole batch:
its forward, chunked loss, backward and AdamW step) and peft + transformers as a user writes it
(model(input_ids, labels).loss.backward(), torch.optim.AdamW(fused=True)), same LoRA (rank 8
on q/k/v/o), same data.

Device command (one H100, carry `.finetunecarry`: made here first by
`bash bench/engine/finetune_carry.sh`):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .finetunecarry/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \
    python3 -m bench.engine.finetune_profile --results-dir "$OUT"
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.common import command_line, markdown_table, results_dir, write_results
from bench.engine.model_setup import LLAMA_8B_8K_SHAPE, SMALL_SHAPE
from fedllm_contract.fine_tuning import FineTuneHyperparameters
from site_engine.engine.models.fused import fuse_linears
from site_engine.finetune.data import IGNORE, Example
from site_engine.finetune.memory import TrainingShape, training_bytes
from site_engine.finetune.trainer import BASE_LEARNING_RATE, LoraTrainer, lora_model

SHAPES = ((1, 256), (4, 256), (8, 512))  # (rows, width) of one optimizer step
WARMUP, UNITS, PROFILED = 2, 5, 2
HP = FineTuneHyperparameters(n_epochs=1, batch_size=1, learning_rate_multiplier=1.0)


def build_model(shape: dict[str, Any], device: torch.device, seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(seed)
    try:  # built on the card in bf16: seconds, and no fp32 copy of 8B weights
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    for layer in model.model.layers:  # as the site's engine holds them (models/llama_fused.py)
        fuse_linears([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
        fuse_linears([layer.mlp.gate_proj, layer.mlp.up_proj])
    model.eval()
    return model


def examples(count: int, width: int, vocab: int, seed: int) -> list[Example]:
    """`count` examples of exactly `width` random tokens, the loss on their last 3/4."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (width,), generator=generator).tolist()
        prompt = width // 4
        out.append(Example(tuple(ids), tuple([IGNORE] * prompt + ids[prompt:])))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def site_steps(model: nn.Module, data: list[Example], rows: int) -> tuple[Callable[[], None], Any]:
    """One optimizer step of the site's trainer a call (its whole batch as one unit)."""
    hp = FineTuneHyperparameters(1, rows, 1.0)
    trainer = LoraTrainer(model, hp, 0, data)
    width = len(data[0].input_ids)

    def step() -> None:
        trainer.work(rows * width)

    return step, trainer.close


def peft_steps(model: nn.Module, data: list[Example], rows: int) -> tuple[Callable[[], None], Any]:
    """One optimizer step of a plain peft + transformers loop a call."""
    device = next(model.parameters()).device
    peft = lora_model(model, HP, 0)
    trainable = [p for p in peft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=BASE_LEARNING_RATE, fused=device.type == "cuda")
    batches = iter(range(0, len(data), rows))

    def step() -> None:
        start = next(batches)
        chunk = data[start : start + rows]
        ids = torch.tensor([e.input_ids for e in chunk], device=device)
        labels = torch.tensor([e.labels for e in chunk], device=device)
        peft(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, lambda: optimizer.state.clear()


def kernel_table(prof: torch.profiler.profile, units: int) -> tuple[str, dict[str, Any]]:
    averages = prof.key_averages()

    def device_us(event: Any) -> float:
        return float(getattr(event, "self_device_time_total", 0.0))

    busy_us = sum(device_us(e) for e in averages)
    launches = sum(e.count for e in averages if e.key in ("cudaLaunchKernel", "cuLaunchKernel"))
    table = averages.table(sort_by="self_device_time_total", row_limit=25)
    return table, {"gpu_busy_ms_per_unit": busy_us / 1000 / units,
                   "kernel_launches_per_unit": launches / units}  # fmt: skip


def measure(
    name: str,
    build: Callable[[nn.Module, list[Example], int], tuple[Callable[[], None], Any]],
    model: nn.Module,
    rows: int,
    width: int,
    profile: bool,
) -> dict[str, Any]:
    device = next(model.parameters()).device
    vocab = int(getattr(model, "config").vocab_size)  # noqa: B009 (a transformers model's)
    steps = WARMUP + UNITS + (PROFILED if profile else 0)
    data = examples(rows * steps, width, vocab, seed=rows * 1000 + width)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    step, close = build(model, data, rows)
    times = []
    for _ in range(WARMUP + UNITS):
        _sync(device)
        began = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated() - before if cuda else None
    measured = times[WARMUP:]
    unit_s = sorted(measured)[len(measured) // 2]
    out: dict[str, Any] = {
        "loop": name,
        "rows": rows,
        "width": width,
        "unit_ms_median": 1000 * unit_s,
        "unit_ms_first": 1000 * times[0],
        "tokens_per_s": rows * width / unit_s,
        "cuda_peak_bytes": peak,
    }
    if profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(PROFILED):
                step()
            _sync(device)
        table, figures = kernel_table(prof, PROFILED)
        out |= figures | {"kernel_table": table}
    close()
    return out


def run(
    model: nn.Module, shapes: Sequence[tuple[int, int]], log: Callable[[str], None]
) -> dict[str, Any]:
    shape = TrainingShape.of_model(model)
    rows_out: list[dict[str, Any]] = []
    for rows, width in shapes:
        site = measure("site", site_steps, model, rows, width, profile=True)
        peft = measure("peft", peft_steps, model, rows, width, profile=rows * width == 256)
        estimate = training_bytes(shape, HP, rows * width, width)
        site["estimate_bytes"] = estimate
        site["peak_over_estimate"] = (
            site["cuda_peak_bytes"] / estimate if site["cuda_peak_bytes"] is not None else None
        )
        site["vs_peft"] = site["tokens_per_s"] / peft["tokens_per_s"]
        log(f"{rows}x{width}: site {site['unit_ms_median']:.1f} ms, "
            f"peft {peft['unit_ms_median']:.1f} ms, site/peft {site['vs_peft']:.2f}, "
            f"peak/estimate {site['peak_over_estimate']}")  # fmt: skip
        rows_out += [site, peft]
    return {"units": rows_out}


def report(result: dict[str, Any]) -> str:
    header = ["loop", "rows x width", "unit ms", "first ms", "tok/s", "vs peft", "GPU busy ms",
              "launches/unit", "peak GiB", "peak/estimate"]  # fmt: skip

    def gib(value: int | None) -> str:
        return "-" if value is None else f"{value / 2**30:.2f}"

    table = markdown_table(
        header,
        [[u["loop"], f"{u['rows']}x{u['width']}", u["unit_ms_median"], u["unit_ms_first"],
          round(u["tokens_per_s"]), u.get("vs_peft", "-"), u.get("gpu_busy_ms_per_unit", "-"),
          u.get("kernel_launches_per_unit", "-"), gib(u["cuda_peak_bytes"]),
          u.get("peak_over_estimate") or "-"] for u in result["units"]],
    )  # fmt: skip
    kernels = "\n\n".join(
        f"### {u['loop']} {u['rows']}x{u['width']}\n\n```\n{u['kernel_table']}\n```"
        for u in result["units"]
        if "kernel_table" in u
    )
    return f"{table}\n\nDevice: {result['device']}.\n\n{kernels}\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.finetune_profile",
                                     description=__doc__)  # fmt: skip
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny model on the CPU")
    parser.add_argument("--results-dir", type=Path, default=results_dir("finetune_colocated"))
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    device = torch.device("cuda" if cuda else "cpu")

    def log(message: str) -> None:
        print(f"[finetune_profile] {message}", flush=True)

    began = time.monotonic()
    shape = LLAMA_8B_8K_SHAPE if cuda else {**SMALL_SHAPE, "max_position_embeddings": 1024}
    model = build_model(shape, device, seed=0)
    log(f"model built on {device} in {time.monotonic() - began:.1f} s")
    shapes = SHAPES if cuda else ((1, 32), (2, 32), (4, 64))
    result: dict[str, Any] = run(model, shapes, log)
    label = torch.cuda.get_device_name() if cuda else "cpu"
    lora = {"rank": HP.lora_rank, "target_modules": list(HP.target_modules)}
    result |= {"device": label, "shape": shape, "lora": lora}
    result["seconds"] = time.monotonic() - began
    name = "finetune_profile_" + ("gpu" if cuda else "cpu")
    command = command_line("bench.engine.finetune_profile", argv)
    log(f"wrote {write_results(name, result, report(result), command, args.results_dir)}")


if __name__ == "__main__":
    main()
