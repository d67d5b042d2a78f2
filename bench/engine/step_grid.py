"""Engine step times over a grid of step shapes: what the federation simulator's step-time model
is fitted on (fedsim/calibrate/, docs/simulator.md).

For each model shape (Llama-3.2-1B and Llama-3.1-8B, random bf16 weights built in memory on the
GPU: no save and reload), one PagedEngine, and for each grid point one step built by hand over
its cache (bench.engine.step_shapes.build_steps: random K/V in the blocks it reads), timed as a
whole `ModelRunner.execute` (inputs, forward, logits, sampling, waiting for the tokens), the
median of `--reps`. The grid: prefill-only steps (one fresh chunk of P tokens, or a chunk of P
after C cached positions), decode-only steps (B rows of context C) and mixed steps (B decode rows
beside a prefill chunk). Then, on an engine serving LoRA adapters, decode steps of 64 rows over
0 (base rows), 1, 4 and 16 distinct adapters (bench.engine.lora_driver.decode_step_s). Each row
records what the simulator's model reads: prefill tokens, decode rows, KV tokens read (each
row's length after the step) and distinct adapters.

    python -m bench.engine.step_grid --results-dir DIR            (GPU: both shapes)
    python -m bench.engine.step_grid --preset cpu --results-dir DIR   (CPU smoke run, tiny shape)

`--engine-steps` also times whole `engine.step()` periods on a filled engine (1-256 decode rows,
async scheduling on and off: bench.engine.decode_sweep's rows, under each model's
"engine_steps"), the engine loop's host time the grid's synchronized execute calls do not show;
fedsim fits its host term on them (fedsim/calibrate/host.py). About 15 s more a model.

On the GPU machine, in ONE device call (about 3 minutes on an H100: both models built, two
engines each, the grid timed), after `bash bench/engine/step_grid_carry.sh` here; carry
`.stepgridcarry`:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .stepgridcarry/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD \
        FEDLLM_SHARED_DIR=$PWD/.stepgridcarry && \
    python3 -m bench.engine.step_grid --engine-steps --results-dir $OUT/sim

It writes DIR/step_grid_<gpu>.json (and .md); copy it to bench/results/sim/ and fit with
`python -m fedsim.calibrate --grid bench/results/sim/step_grid_<gpu>.json`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import command_line, markdown_table, write_results
from bench.engine.decode_sweep import decode_sweep
from bench.engine.harness import GIB, Progress
from bench.engine.lora_driver import adapter_names, decode_step_s, write_adapters
from bench.engine.model_setup import LLAMA_1B_SHAPE, LLAMA_8B_8K_SHAPE
from bench.engine.paths import shared_path
from bench.engine.presets import device_label, tiny_shape
from bench.engine.roofline import measure_copy_bandwidth
from bench.engine.step_shapes import PrefillChunk, StepShape, _randomize_cache, build_steps
from fedllm_contract.tokenizer import load_tokenizer
from site_engine.engine.lora.adapter import BaseShapes
from site_engine.engine.lora.registry import LoraSettings
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel

PRESETS: dict[str, dict[str, Any]] = {
    "gpu": {
        "models": {"llama1b": LLAMA_1B_SHAPE, "llama8b": LLAMA_8B_8K_SHAPE},
        "device": "cuda",
        "dtype": torch.bfloat16,
        "kv_gib": 20.0,
        "prefill": (16, 64, 256, 512, 1024, 2048),
        "cached": (0, 2048),
        "decode_rows": (1, 8, 32, 64, 128, 256),
        "contexts": (128, 512, 2048),
        "mixed_rows": (32, 128),
        "mixed_prefill": (256, 1024, 2048),
        "adapters": (0, 1, 4, 16),
        "adapter_rows": 64,
        "adapter_steps": 10,
        "reps": 7,
        "warmup": 2,
        # --engine-steps: whole engine.step() calls on a filled engine (bench.engine.decode_sweep)
        "engine_rows": (1, 32, 64, 128, 256),
        "engine_prompt_len": 512,
        "engine_steps": 32,
    },
    "cpu": {
        "models": {"tiny": tiny_shape(512)},
        "device": "cpu",
        "dtype": torch.float32,
        "kv_gib": 0.05,
        "prefill": (8, 32),
        "cached": (0, 32),
        "decode_rows": (1, 4),
        "contexts": (16, 64),
        "mixed_rows": (4,),
        "mixed_prefill": (32,),
        "adapters": (0, 1, 2),
        "adapter_rows": 4,
        "adapter_steps": 2,
        "reps": 2,
        "warmup": 1,
        "engine_rows": (1, 4),
        "engine_prompt_len": 16,
        "engine_steps": 3,
    },
}


def grid(p: dict[str, Any]) -> list[StepShape]:
    """The grid's step shapes (names say what each holds)."""
    shapes = [
        StepShape(f"prefill{n}_cached{c}", "prefill only", 0, 0, (PrefillChunk(c, n),))
        for n in p["prefill"]
        for c in p["cached"]
    ]
    shapes += [
        StepShape(f"decode{b}_ctx{c}", "decode only", b, c, ())
        for b in p["decode_rows"]
        for c in p["contexts"]
    ]
    shapes += [
        StepShape(f"mixed{b}_prefill{n}", "mixed", b, p["contexts"][1], (PrefillChunk(0, n),))
        for b in p["mixed_rows"]
        for n in p["mixed_prefill"]
    ]
    return shapes


def kv_read_tokens(shape: StepShape) -> int:
    """KV positions the step's rows read: each row's length after the step."""
    return shape.decode_rows * shape.decode_context + sum(c.cached + c.new for c in shape.prefill)


def build_model(shape: dict[str, Any], dtype: torch.dtype, device: str, seed: int) -> LoadedModel:
    """A random LlamaForCausalLM of `shape`, built on `device` in `dtype` and kept in memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_tokenizer(shared_path(None, "tokenizers", "gpt2"))
    eos = int(tokenizer.eos_token_id) if tokenizer.eos_token_id is not None else 0
    config = LlamaConfig(**shape, bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: no float32 copy of 8B parameters
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        max_model_len=int(shape["max_position_embeddings"]),
        eos_token_ids=frozenset({eos}),
        device=torch.device(device),
        dtype=dtype,
    )


def _engine(
    loaded: LoadedModel,
    p: dict[str, Any],
    shapes: Sequence[StepShape],
    lora: LoraSettings | None = None,
) -> PagedEngine:
    seqs = max(max(s.decode_rows + len(s.prefill) for s in shapes), p["adapter_rows"])
    return PagedEngine(
        loaded,
        EngineConfig(
            max_num_seqs=seqs,
            max_num_batched_tokens=max(max(s.tokens for s in shapes), 256),
            kv_cache_bytes=int(p["kv_gib"] * GIB),
            lora=lora,
        ),
    )


def _close(engine: PagedEngine) -> None:
    """Its KV cache back to the device before the next engine takes one."""
    engine.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(loaded: LoadedModel) -> None:
    if loaded.device.type == "cuda":
        torch.cuda.synchronize()


def time_grid(loaded: LoadedModel, p: dict[str, Any], log: Progress) -> list[dict[str, Any]]:
    """One row per grid shape: its inputs and the median ms of its step (skipped when its KV
    does not fit the cache)."""
    shapes = grid(p)
    engine = _engine(loaded, p, shapes)
    runner = engine.runner
    rows: list[dict[str, Any]] = []
    for index, shape in enumerate(shapes):
        row: dict[str, Any] = {
            "shape": shape.name,
            "prefill_tokens": shape.prefill_tokens,
            "decode_rows": shape.decode_rows,
            "kv_read_tokens": kv_read_tokens(shape),
            "prefill_attention": sum(c.new * (c.cached + c.new) for c in shape.prefill),
            "adapters": 0,
        }
        try:
            step = build_steps(
                shape, runner.block_size, runner.num_blocks, loaded.vocab_size, index
            )["mixed"]
        except ValueError as exc:  # more blocks than the cache has
            rows.append(row | {"skipped": str(exc)})
            continue
        used = max(max(c.block_table) for c in step.chunks) + 1
        _randomize_cache(runner, used)
        times = []
        for rep in range(p["warmup"] + p["reps"]):
            _sync(loaded)
            began = time.perf_counter()
            step.run(runner)  # waits for the sampled tokens: the step's work is done
            if rep >= p["warmup"]:
                times.append((time.perf_counter() - began) * 1000.0)
        rows.append(row | {"ms": statistics.median(times), "ms_all": times})
        log(f"  {shape.name}: {rows[-1]['ms']:.2f} ms")
    _close(engine)
    return rows


def time_adapters(
    loaded: LoadedModel, p: dict[str, Any], root: Path, log: Progress
) -> list[dict[str, Any]]:
    """Decode steps of `adapter_rows` rows over 0 (base rows on the LoRA engine), 1, 4, 16
    distinct adapters (rank 16, all seven projections), each the mean over `adapter_steps`."""
    counts = [c for c in p["adapters"] if c > 0]
    # Four distinct weight files, linked under every name: slots hold copies, the bytes need not
    # differ (as bench.engine.lora does), and writing sixteen 8B adapters would cost seconds.
    write_adapters(root, BaseShapes.of_model(loaded.model), max(counts), 4, 16)
    slots = max(counts)
    settings = LoraSettings(root, max_loras=slots, max_cpu_loras=slots, max_rank=16)
    engine = _engine(loaded, p, grid(p), settings)
    names = adapter_names(max(counts))
    rows = []
    context = 64  # decode_step_s's prompts (32) plus the steps it runs first, about
    for count in p["adapters"]:
        chosen: list[str | None] = [None] if count == 0 else list(names[:count])
        seconds = decode_step_s(
            engine,
            loaded.vocab_size,
            p["adapter_rows"],
            chosen,
            p["adapter_steps"],
            seed=100 + count,
        )
        rows.append(
            {
                "shape": f"lora_decode{p['adapter_rows']}_adapters{count}",
                "prefill_tokens": 0,
                "decode_rows": p["adapter_rows"],
                "kv_read_tokens": p["adapter_rows"] * context,
                "prefill_attention": 0,
                "adapters": count,
                "ms": seconds * 1000.0,
                "lora_engine": True,
            }
        )
        log(f"  {rows[-1]['shape']}: {rows[-1]['ms']:.2f} ms")
    _close(engine)
    return rows


def time_engine_steps(
    loaded: LoadedModel, p: dict[str, Any], log: Progress
) -> list[dict[str, Any]]:
    """Whole engine.step() periods on a filled engine, b decode rows, async scheduling on and
    off (decode_sweep's rows): the grid times ModelRunner.execute synchronized, so only these
    hold the engine loop's host time and what async scheduling hides of it (fedsim's
    HostOverhead is fitted on them)."""
    args = argparse.Namespace(
        decode_batch_sizes=p["engine_rows"],
        decode_prompt_len=p["engine_prompt_len"],
        decode_steps=p["engine_steps"],
        decode_warmup_steps=p["warmup"],
        max_num_batched_tokens=4096,
        block_size=16,
        seed=0,
    )
    mib = 256 if loaded.device.type == "cuda" else 8
    bandwidth = measure_copy_bandwidth(loaded.device, mib << 20)["read_write_bytes_per_s"]
    return decode_sweep(loaded, args, bandwidth, budget_s=120.0, log=log)


def run_model(
    name: str, shape: dict[str, Any], p: dict[str, Any], log: Progress, engine_steps: bool = False
) -> dict[str, Any]:
    began = time.perf_counter()
    loaded = build_model(shape, p["dtype"], p["device"], seed=0)
    log(f"{name}: built in {time.perf_counter() - began:.1f} s")
    steps = time_grid(loaded, p, log)
    engine_rows = time_engine_steps(loaded, p, log) if engine_steps else None
    try:
        steps += time_adapters(loaded, p, Path(f"/tmp/fedllm-stepgrid-adapters-{name}"), log)
    except Exception as exc:  # the base grid stands without the adapter rows; say why
        log(f"{name}: adapter steps failed: {exc!r}")
        steps.append({"shape": "lora", "skipped": repr(exc)})
    result = {
        "model": name,
        "shape": shape,
        "device": device_label(loaded),
        "seconds": time.perf_counter() - began,
        "steps": steps,
    }
    if engine_rows is not None:
        result["engine_steps"] = engine_rows
    del loaded
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def report(models: Sequence[dict[str, Any]]) -> str:
    rows = [
        (
            m["model"],
            s["shape"],
            s["prefill_tokens"],
            s["decode_rows"],
            s["kv_read_tokens"],
            s["adapters"],
            f"{s['ms']:.2f}",
        )
        for m in models
        for s in m["steps"]
        if "ms" in s
    ]
    header = ("model", "step", "prefill", "decode rows", "KV read", "adapters", "ms")
    return markdown_table(header, rows)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engine.step_grid")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    parser.add_argument("--models", nargs="*", default=None, help="a subset of the preset's")
    parser.add_argument("--results-dir", type=Path, required=True)
    parser.add_argument(
        "--engine-steps",
        action="store_true",
        help="also time whole engine.step() calls on a filled engine (the host overhead)",
    )
    args = parser.parse_args(argv)
    p = PRESETS[args.preset]
    log = Progress()
    models = [
        run_model(name, shape, p, log, args.engine_steps)
        for name, shape in p["models"].items()
        if args.models is None or name in args.models
    ]
    device = models[0]["device"] if models else "none"
    payload = {"preset": args.preset, "device": device, "models": models}
    path = write_results(
        f"step_grid_{device}",
        payload,
        report(models),
        command_line("bench.engine.step_grid", argv),
        args.results_dir,
    )
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
