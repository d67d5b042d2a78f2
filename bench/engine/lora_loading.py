"""Where a LoRA adapter's load from disk goes, and loads/s with 1 vs N loader threads (issue 51).

K random PEFT adapters (rank 16 on all seven projections; site_engine/engine/lora/
random_adapter.py) are written for each model shape, then:

1. Phases, one load at a time: the config; the weights file's header and every check
   (weights_file.read_header + the adapter checks); the layout (mapping the file and the one
   copy per tensor that transposes and converts it: where the data is read). Beside it, the
   previous path (safetensors.load_file, checks on the tensors, `.t().to(dtype).contiguous()`),
   timed the same way.
2. Throughput: the K adapters requested at once from an AdapterRegistry with max_loads = 1, 2,
   4 (what the engine does when K cold adapters' requests arrive): loads/s until all are in
   host memory, and the longest the calling thread (the engine's, in a site) went without
   getting the GIL back meanwhile, measured by a 1 ms sleep loop.

Page cache: `hot` reads files just read (a second pass); `cold` first drops each file's pages
with posix_fadvise(DONTNEED) (no root needed; the pages of a clean file go). On a VM the host
may still cache the disk, so `cold` is a floor on what a real cold read costs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from bench.common import command_line, markdown_table, results_dir, write_results
from bench.engine.metrics import percentile
from bench.engine.model_setup import LLAMA_1B_SHAPE, LLAMA_8B_SHAPE
from site_engine.engine.lora import adapter as lora_adapter
from site_engine.engine.lora.adapter import (
    CONFIG_FILE,
    PROJECTIONS,
    WEIGHTS_FILE,
    BaseShapes,
    read_adapter,
    read_config,
)
from site_engine.engine.lora.host_layout import HostLayout, lay_out_file
from site_engine.engine.lora.random_adapter import write_random_adapter
from site_engine.engine.lora.registry import AdapterRegistry, LoraSettings
from site_engine.engine.lora.weights_file import TensorEntry, map_file, read_header

RANK = 16
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def base_shapes(shape: dict[str, Any]) -> BaseShapes:
    """A Llama shape's layer count and per-projection (in, out) features."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = shape.get("head_dim") or hidden // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    features = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    return BaseShapes(shape["num_hidden_layers"], features)


def drop_cached(path: Path) -> None:
    """Drops the file's clean pages from the page cache (advice the kernel follows on Linux)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def phases_now(
    path: Path, base: BaseShapes, dtype: torch.dtype, pin: bool = False
) -> dict[str, float]:
    """read_adapter's steps, timed (ms); the same calls it makes, in its order."""
    t0 = time.perf_counter()
    rank, _ = read_config(path, RANK)
    t1 = time.perf_counter()
    entries = read_header(path / WEIGHTS_FILE)
    pairs = lora_adapter._pairs(entries)
    for where, pair in pairs.items():
        lora_adapter._check_pair(where, pair, entries, rank, base)
    t2 = time.perf_counter()
    raw = map_file(path / WEIGHTS_FILE)
    kept = lay_out_file(raw, entries, pairs, HostLayout(base, RANK), rank, dtype, pin)
    t3 = time.perf_counter()
    del kept, raw
    return {"config": t1 - t0, "header_checks": t2 - t1, "layout": t3 - t2, "total": t3 - t0}


def phases_before(path: Path, base: BaseShapes, dtype: torch.dtype) -> dict[str, float]:
    """The path before this bench (safetensors.load_file; checks on the loaded tensors)."""
    t0 = time.perf_counter()
    rank, _ = read_config(path, RANK)
    t1 = time.perf_counter()
    tensors = load_file(str(path / WEIGHTS_FILE), device="cpu")
    # The same checks, on the loaded tensors' shapes (as before: read first, then checked).
    shapes = {k: TensorEntry(t.dtype, tuple(t.shape), 0, 0) for k, t in tensors.items()}
    for where, pair in lora_adapter._pairs(shapes).items():
        lora_adapter._check_pair(where, pair, shapes, rank, base)
    t2 = time.perf_counter()
    kept = [t.t().to(dtype).contiguous() for t in tensors.values()]
    t3 = time.perf_counter()
    del kept, tensors
    return {"config": t1 - t0, "header_checks": t2 - t1, "layout": t3 - t2, "total": t3 - t0}


def time_phases(
    paths: Sequence[Path],
    base: BaseShapes,
    dtype: torch.dtype,
    cold: bool,
    how: Callable[[Path, BaseShapes, torch.dtype], dict[str, float]],
) -> dict[str, dict[str, float]]:
    samples: dict[str, list[float]] = {}
    for path in paths:
        if cold:
            drop_cached(path / WEIGHTS_FILE)
        for phase, seconds in how(path, base, dtype).items():
            samples.setdefault(phase, []).append(seconds * 1e3)
    return {
        phase: {"p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99)}
        for phase, v in samples.items()
    }


def throughput(
    root: Path, names: Sequence[str], base: BaseShapes, dtype: torch.dtype, loads: int, cold: bool
) -> dict[str, float]:
    """All `names` requested at once from a registry with `loads` loader threads."""
    if cold:
        for name in names:
            drop_cached(root / name / WEIGHTS_FILE)
    settings = LoraSettings(root, 1, max(len(names), 1), RANK, max_loads=loads)
    registry = AdapterRegistry(settings, base, dtype, torch.device("cpu"))
    started = time.perf_counter()
    for name in names:
        registry.request(name)
    stall, done = 0.0, 0
    while done < len(names):
        before = time.perf_counter()
        time.sleep(0.001)
        stall = max(stall, time.perf_counter() - before - 0.001)
        ready, failed = registry.settle(lambda: set(names))
        if failed:
            raise RuntimeError(f"loads failed: {failed}")
        done += len(ready)
    elapsed = time.perf_counter() - started
    registry.close()
    return {"loads_per_s": len(names) / elapsed, "seconds": elapsed, "max_stall_ms": stall * 1e3}


def _paths() -> list[tuple[str, Callable[[Path, BaseShapes, torch.dtype], dict[str, float]]]]:
    """The load paths timed: with CUDA, also the site's own (page-locked host copies)."""
    paths: list[tuple[str, Callable[[Path, BaseShapes, torch.dtype], dict[str, float]]]]
    paths = [("now", phases_now), ("before", phases_before)]
    if torch.cuda.is_available():
        paths.append(("now_pinned", lambda path, base, dtype: phases_now(path, base, dtype, True)))
    return paths


def write_adapters(root: Path, base: BaseShapes, count: int) -> list[str]:
    names = [f"a{i:03d}" for i in range(count)]
    for i, name in enumerate(names):
        write_random_adapter(root / name, base, RANK, 2 * RANK, PROJECTIONS, seed=i)
    return names


def run_shape(
    label: str, shape: dict[str, Any], count: int, dtypes: Sequence[str], threads: Sequence[int]
) -> dict[str, Any]:
    base = base_shapes(shape)
    root = Path(tempfile.mkdtemp(prefix=f"lora-loading-{label}-"))
    try:
        names = write_adapters(root, base, count)
        paths = [root / n for n in names]
        size = (paths[0] / WEIGHTS_FILE).stat().st_size
        assert (paths[0] / CONFIG_FILE).is_file()
        result: dict[str, Any] = {"adapters": count, "file_mb": size / 1e6, "by_dtype": {}}
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            read_adapter(paths[0], "check", base, RANK, dtype)  # one full load: it must pass
            by: dict[str, Any] = {"phases": {}, "throughput": {}}
            for cache in ("hot", "cold"):
                cold = cache == "cold"
                for how, fn in _paths():
                    time_phases(paths[:2], base, dtype, False, fn)  # warm the code paths
                    by["phases"][f"{how}_{cache}"] = time_phases(paths, base, dtype, cold, fn)
                for loads in threads:
                    by["throughput"][f"{loads}_{cache}"] = throughput(
                        root, names, base, dtype, loads, cold
                    )
            result["by_dtype"][dtype_name] = by
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(result: dict[str, Any]) -> str:
    lines = [
        f"Rank {RANK} on all seven projections; torch threads {result['torch_threads']}. "
        "`now`: site_engine/engine/lora/adapter.py (header checks, mapped file, one copy per "
        "tensor; `now_pinned`: then page-locked, what a CUDA site keeps); `before`: "
        "safetensors.load_file, checks on the tensors, "
        "`.t().to(dtype).contiguous()`. `cold`: each file's pages dropped first "
        "(posix_fadvise DONTNEED; the VM's host may still cache the disk).",
        "",
    ]
    for label, shape in result["shapes"].items():
        for dtype_name, by in shape["by_dtype"].items():
            lines += [
                f"## {label}: {shape['adapters']} adapters of {shape['file_mb']:.1f} MB, "
                f"served in {dtype_name}",
                "",
            ]
            rows = [
                [arm, *(f"{p[ph]['p50_ms']:.1f} / {p[ph]['p99_ms']:.1f}" for ph in _PHASES)]
                for arm, p in by["phases"].items()
            ]
            lines += [markdown_table(["path_cache", *(f"{ph} p50/p99 ms" for ph in _PHASES)], rows)]
            lines.append("")
            rows = [
                [key, f"{t['loads_per_s']:.1f}", f"{t['seconds']:.2f}", f"{t['max_stall_ms']:.1f}"]
                for key, t in by["throughput"].items()
            ]
            header = ["loaders_cache", "loads/s", "all loaded s", "engine thread max stall ms"]
            lines += [markdown_table(header, rows), ""]
    return "\n".join(lines)


_PHASES = ("config", "header_checks", "layout", "total")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters-8b", type=int, default=16, help="8B adapters (~84 MB each)")
    parser.add_argument("--adapters-1b", type=int, default=48, help="1B adapters (~23 MB each)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="intra-op threads (a site's --torch-threads)"
    )
    parser.add_argument("--name", default="lora_loading_cpu")
    parser.add_argument("--results-dir", type=Path, default=results_dir("engine_lora"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    shapes = {
        "llama-3-8b": (LLAMA_8B_SHAPE, args.adapters_8b, ["bfloat16"]),
        "llama-3.2-1b": (LLAMA_1B_SHAPE, args.adapters_1b, ["bfloat16", "float32"]),
    }
    result: dict[str, Any] = {"rank": RANK, "torch_threads": torch.get_num_threads(), "shapes": {}}
    for label, (shape, count, dtypes) in shapes.items():
        print(f"{label}: {count} adapters", flush=True)
        result["shapes"][label] = run_shape(label, shape, count, dtypes, args.threads)
    path = write_results(
        args.name, result, report(result), command_line("bench.engine.lora_loading", argv),
        args.results_dir,
    )  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
