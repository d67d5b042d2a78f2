"""How long an adapter's load takes while the engine's thread runs Python (issue 77).

A site reads adapters on loader threads while its engine thread steps. Each torch operation a
loader runs gives the GIL up and takes it back; while the engine thread runs Python the loader
waits up to the interpreter's switch interval (5 ms) each time. So a load's time grows with the
number of operations it makes and with how busy the engine thread is.

One 8B-shaped rank-16 adapter (seven projections, 84 MB in bf16), read `--loads` times by one
loader thread, beside a thread that runs Python a `busy` fraction of each 4 ms and sleeps the
rest (an engine thread's host work between its device waits), for each busy fraction and each
path:
- `grouped`: the site's path (site_engine/engine/lora/host_layout.py: each projection's A or B
  tensors of every layer in one strided copy, the checks over the whole file at once);
- `per_tensor`: the same checks and layout, tensor by tensor (the path before, and the
  fallback for files laid out otherwise: ~9 operations a tensor, 448 tensors).

Keys: `load_s` {path: {busy: p50 seconds}}, `loads_per_s` {path: {busy: loads/s}},
`grouped_vs_per_tensor` {busy: per-tensor p50 / grouped p50}.

    python -m bench.engine.lora_loading_gil [--loads 8] [--busy 0 0.5 0.9]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import command_line, markdown_table, results_dir, write_results
from bench.engine.metrics import percentile
from site_engine.engine.lora.adapter import (
    PROJECTIONS,
    WEIGHTS_FILE,
    BaseShapes,
    _checked,
    check_adapter,
    read_adapter,
)
from site_engine.engine.lora.host_layout import HostLayout, lay_out_pairs
from site_engine.engine.lora.random_adapter import write_random_adapter
from site_engine.engine.lora.weights_file import map_tensors

RANK = 16
SLICE_S = 0.004
LLAMA_8B = BaseShapes(
    32,
    {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024),
     "o_proj": (4096, 4096), "gate_proj": (4096, 14336), "up_proj": (4096, 14336),
     "down_proj": (14336, 4096)},
)  # fmt: skip


def per_tensor(path: Path, dtype: torch.dtype) -> None:
    rank, _, entries, pairs = check_adapter(path, LLAMA_8B, RANK)
    tensors = map_tensors(path / WEIGHTS_FILE, entries)
    weights = {}
    for where, pair in pairs.items():
        a = _checked(tensors[pair["A"]], where, "A", dtype)
        weights[where] = (a, _checked(tensors[pair["B"]], where, "B", dtype))
    lay_out_pairs(weights, HostLayout(LLAMA_8B, RANK), rank, dtype)


def grouped(path: Path, dtype: torch.dtype) -> None:
    read_adapter(path, "a", LLAMA_8B, RANK, dtype)


def _busy_thread(busy: float, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        count = 0
        while not stop.is_set():
            started = time.perf_counter()
            while time.perf_counter() - started < SLICE_S * busy:
                count += 1
            time.sleep(SLICE_S * (1 - busy) + 1e-6)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def measure(
    load: Callable[[Path, torch.dtype], None], path: Path, busy: float, loads: int
) -> tuple[float, float]:
    """(p50 seconds a load, loads a second) beside a thread `busy` with Python."""
    stop = threading.Event()
    thread = _busy_thread(busy, stop)
    times = []
    started = time.perf_counter()
    for _ in range(loads):
        t0 = time.perf_counter()
        load(path, torch.bfloat16)
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - started
    stop.set()
    thread.join()
    return percentile(times, 50), loads / wall


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", type=int, default=8)
    parser.add_argument("--busy", type=float, nargs="+", default=[0.0, 0.5, 0.9])
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    paths: dict[str, Callable[[Path, torch.dtype], None]] = {
        "grouped": grouped,
        "per_tensor": per_tensor,
    }
    load_s: dict[str, dict[str, float]] = {name: {} for name in paths}
    rates: dict[str, dict[str, float]] = {name: {} for name in paths}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "adapter"
        write_random_adapter(path, LLAMA_8B, RANK, 2 * RANK, PROJECTIONS, seed=0, scale=0.02)
        for busy in args.busy:
            for name, load in paths.items():  # in turn at each busy fraction
                p50, rate = measure(load, path, busy, args.loads)
                load_s[name][str(busy)], rates[name][str(busy)] = p50, rate
                print(f"busy {busy}: {name} p50 {p50 * 1000:.0f} ms, {rate:.2f} loads/s")
    ratio = {b: load_s["per_tensor"][b] / load_s["grouped"][b] for b in load_s["grouped"]}
    results: dict[str, Any] = {
        "adapter": "Llama-3-8B shape, rank 16, seven projections, bf16 (84 MB)",
        "loads": args.loads,
        "load_s": load_s,
        "loads_per_s": rates,
        "grouped_vs_per_tensor": ratio,
    }
    rows = [
        [busy, f"{load_s['per_tensor'][busy] * 1000:.0f}", f"{load_s['grouped'][busy] * 1000:.0f}",
         f"{ratio[busy]:.2f}x", f"{rates['grouped'][busy]:.2f}"]
        for busy in load_s["grouped"]
    ]  # fmt: skip
    table = markdown_table(
        ["engine thread busy", "per tensor p50 ms", "grouped p50 ms", "gain", "grouped loads/s"],
        rows,
    )
    out = args.results_dir or results_dir("engine_lora")
    doc = (__doc__ or "").split("\n    python -m")[0].strip()
    command = command_line("bench.engine.lora_loading_gil", argv)
    write_results("lora_loading_gil", results, f"{doc}\n\n{table}", command, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
