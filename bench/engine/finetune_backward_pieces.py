"""Issue 76's next question, on the card alone: how fast a training job's input gradient runs in
pieces that fit between decode steps, and what riding rows cost a decode step's GEMMs.

finetune_sharing_physics.md ("Rows inside the forward") puts the design that could reach 0.6 of
the job alone at load 0.3 on two figures it could only assume: the input gradient (dX = dY W, a
second pass over the weights) at the GEMM rate in ~1 ms pieces of a few layers, and a training
row in the forward costing about what a decode row costs. This probe measures both on the
Llama-3-8B layer shapes, with random bf16 weights (32 layers, every projection its own tensor,
so no piece reads its weights from the L2):

- `pieces`: dX for N tokens over a slice of S layers (every projection of each), for N from 64
  to 2,048 and S of 4, 8, 16: time, achieved TFLOP/s, and the two floors (the slice's weights at
  the copy rate measured in the same run; its FLOPs at the rate of the largest piece).
- `riding`: the forward GEMMs of every layer for b chat rows plus r training rows (b 32 and 128):
  the GEMM time a riding row adds, against the step's ~14 µs a row measured in the engine.

`python -m bench.engine.finetune_backward_pieces` on a CUDA machine (torch only, ~1 minute).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import command_line, markdown_table, results_dir, write_results

HIDDEN, INTERMEDIATE, KV = 4096, 14336, 1024
LAYERS = 32
# (out_features, in_features) of each projection of one layer, as nn.Linear stores them.
PROJECTIONS = {
    "q": (HIDDEN, HIDDEN), "k": (KV, HIDDEN), "v": (KV, HIDDEN), "o": (HIDDEN, HIDDEN),
    "gate": (INTERMEDIATE, HIDDEN), "up": (INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE),
}  # fmt: skip
LAYER_PARAMS = sum(o * i for o, i in PROJECTIONS.values())
TOKENS = (64, 128, 180, 256, 512, 1024, 2048)
SLICES = (4, 8, 16)
CHAT_ROWS = (32, 128)
RIDING = (0, 32, 64, 96, 128, 160, 256)
PIECE_HEADER = ("layers", "tokens", "ms", "TFLOP/s", "floor ms", "over floor",
                "µs a token, 32 layers")  # fmt: skip


def _timed(run: Callable[[], None], reps: int) -> float:
    """Median seconds of `run` over `reps` timed calls, after three warm-up calls."""
    for _ in range(3):
        run()
    times = []
    for _ in range(reps):
        start, end = _event(), _event()
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(statistics.median(times))


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _copy_rate(reps: int) -> float:
    """Bytes a second of a 4 GiB device-to-device copy (read + write counted once each)."""
    source = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda")
    target = torch.empty_like(source)

    def copy() -> None:
        target.copy_(source)

    return 2 * (1 << 32) / _timed(copy, reps)


def _weights() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    return [
        {
            name: torch.randn(shape, generator=generator, device="cuda", dtype=torch.bfloat16)
            * 0.02
            for name, shape in PROJECTIONS.items()
        }
        for _ in range(LAYERS)
    ]


def _input_gradient(layers: Sequence[dict[str, torch.Tensor]], tokens: int) -> Callable[[], None]:
    """dX = dY W for every projection of `layers`: what a LoRA job's backward spends on the
    frozen base (its adapters' own gradients are ~0.4 % of the FLOPs)."""
    grads = {n: torch.randn(tokens, o, device="cuda", dtype=torch.bfloat16)
             for n, (o, _) in PROJECTIONS.items()}  # fmt: skip

    def run() -> None:
        for layer in reversed(layers):
            for name, weight in layer.items():
                torch.mm(grads[name], weight)

    return run


def _forward(layers: Sequence[dict[str, torch.Tensor]], rows: int) -> Callable[[], None]:
    inputs = {n: torch.randn(rows, i, device="cuda", dtype=torch.bfloat16)
              for n, (_, i) in PROJECTIONS.items()}  # fmt: skip

    def run() -> None:
        for layer in layers:
            for name, weight in layer.items():
                torch.nn.functional.linear(inputs[name], weight)

    return run


def measure(reps: int) -> dict[str, Any]:
    copy_rate = _copy_rate(reps)
    layers = _weights()
    layer_bytes = LAYER_PARAMS * 2
    pieces = []
    for layer_count in SLICES:
        for tokens in TOKENS:
            seconds = _timed(_input_gradient(layers[:layer_count], tokens), reps)
            flops = 2 * LAYER_PARAMS * layer_count * tokens
            pieces.append({
                "layers": layer_count, "tokens": tokens, "ms": seconds * 1e3,
                "tflops": flops / seconds / 1e12,
                "weights_floor_ms": layer_count * layer_bytes / copy_rate * 1e3,
                "us_per_token_layer": seconds * 1e6 / (tokens * layer_count),
            })  # fmt: skip
    riding = []
    for chat in CHAT_ROWS:
        alone = _timed(_forward(layers, chat), reps)
        for extra in RIDING:
            seconds = _timed(_forward(layers, chat + extra), reps) if extra else alone
            riding.append({
                "chat_rows": chat, "riding_rows": extra, "ms": seconds * 1e3,
                "added_us_per_riding_row": (seconds - alone) * 1e6 / extra if extra else 0.0,
            })  # fmt: skip
    best = max(p["tflops"] for p in pieces)
    for piece in pieces:
        flops_ms = 2 * LAYER_PARAMS * piece["layers"] * piece["tokens"] / (best * 1e12) * 1e3
        piece["floor_ms"] = max(piece["weights_floor_ms"], flops_ms)
        piece["over_floor"] = piece["ms"] / piece["floor_ms"]
    return {
        "copy_rate_bytes_per_s": copy_rate,
        "best_tflops": best,
        "weights_ms_all_layers": LAYERS * layer_bytes / copy_rate * 1e3,
        "pieces": pieces,
        "riding": riding,
        "device": torch.cuda.get_device_name(0),
    }


def report(result: dict[str, Any]) -> str:
    piece_rows = [
        (p["layers"], p["tokens"], p["ms"], p["tflops"], p["floor_ms"], p["over_floor"],
         p["us_per_token_layer"] * LAYERS)
        for p in result["pieces"]
    ]  # fmt: skip
    riding_rows = [
        (r["chat_rows"], r["riding_rows"], r["ms"], r["added_us_per_riding_row"])
        for r in result["riding"]
    ]
    return "\n\n".join(
        [
            f"Device: {result['device']}. Copy rate {result['copy_rate_bytes_per_s'] / 1e12:.2f} "
            f"TB/s (all 32 layers' weights: {result['weights_ms_all_layers']:.2f} ms); the best "
            f"input-gradient piece ran at {result['best_tflops']:.0f} TFLOP/s.",
            "## Input gradient in pieces (dX = dY W, every projection of S layers, last layer "
            "first)\n\n`floor` is the larger of the slice's weights at the copy rate and its FLOPs "
            "at the best piece's rate; `µs a token, 32 layers` is what a whole backward would cost "
            "a token at that piece size.\n\n" + markdown_table(PIECE_HEADER, piece_rows),
            "## Training rows riding a decode step's forward GEMMs (all 32 layers)\n\n"
            + markdown_table(
                ("chat rows", "riding rows", "GEMMs ms", "added µs a riding row"), riding_rows
            ),
        ]
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="input-gradient pieces and riding rows (issue 76)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--name", default="finetune_backward_pieces_h200")
    parser.add_argument("--out-dir", type=Path, default=results_dir("finetune_colocated"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("finetune_backward_pieces needs a CUDA device")
    result = measure(args.reps)
    command = command_line("bench.engine.finetune_backward_pieces", argv)
    path = write_results(args.name, result, report(result), command, args.out_dir)
    print(path.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
