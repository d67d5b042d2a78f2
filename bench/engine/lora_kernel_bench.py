"""`python -m bench.engine.lora_profile --kernels-only`: the engine's multi-LoRA kernels
(cuda/lora_segmented.py) alone, against the bytes they must move (issues 69, 77).

For the 8B shape at rank 16 on all seven projections (64 slots), a decode step of 256 rows over
8 and over 64 adapters and a prefill step of 2,048 rows over 8, each stack's kernels run over
`LAYERS` layers of distinct slot tensors (1.3 GB at 64 adapters: the weights stream from memory
as in the engine, not from L2).

Timed as CUDA graph replays (the slot sort once, then the layers' launches, as a step's graph
runs them), so launch gaps count as they do in the engine: per stack and layer the shrink's
time, the whole stack's, and all four stacks of a layer back to back. Bytes per stack are
bench/engine/lora_bytes.py's floor (A and B of the slots in use, the rows' inputs once and
outputs read and written); achieved rate = bytes / time, and its fraction of the card's copy
rate measured in the same run. `SEEDS` row orders: median and min-max. The deltas are checked
against a float32 PyTorch reference on layer 0.

The kernel paths this bench compared the segmented kernels with are gone: issue 69's one-launch
kernels (git show 8494ebf:bench/engine/lora_kernel_bench.py) and issue 77's split-K kernels with
their tunables' variants (git tag study/lora-splitk).

On the CPU (`--preset cpu`) the same code runs a tiny shape through Triton's interpreter: a
smoke run of the script, no timing worth reading.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from bench.engine.lora_bytes import StackBytes, shapes_of, stack_bytes, unique_stacks
from bench.engine.roofline import measure_copy_bandwidth
from site_engine.engine.lora.stacks import Stack

CASES = {
    "gpu": (("decode_8", 256, 8), ("decode_64", 256, 64), ("prefill_8", 2048, 8)),
    "cpu": (("decode_4", 16, 4), ("prefill_2", 520, 2)),
}
LAYERS = {"gpu": 8, "cpu": 2}
SLOTS = {"gpu": 64, "cpu": 4}
SEEDS = {"gpu": 3, "cpu": 1}  # row orders timed (the CPU run is a smoke run)
REPLAYS = 20
MODULE = "site_engine.engine.cuda.lora_segmented"
Op = Callable[[int, int, bool], None]  # (stack index, layer, shrink only) -> None


def kernel_module(device: torch.device) -> ModuleType:
    """The kernels' module: imported on CUDA, an interpreted copy on the CPU."""
    import importlib

    if device.type == "cuda":
        return importlib.import_module(MODULE)
    from devtools.triton_interpreter import interpreted_module

    return interpreted_module(MODULE)


class Inputs:
    """One case's tensors: per stack A [layers, slots, in, n*R], B [layers, slots, R, out], x
    [T, in], y [layers, T, out]; the slot scalings; the rows' slots (row i: adapter i % n)."""

    def __init__(self, stacks: list[Stack], layers: int, slots: int, rank: int, tokens: int,
                 adapters: int, dtype: torch.dtype, device: torch.device) -> None:  # fmt: skip
        gen = torch.Generator(device="cpu").manual_seed(0)

        def rand(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * 0.02).to(device, dtype)

        self.stacks = stacks
        self.a = [rand(layers, slots, s.in_features, len(s.widths) * rank) for s in stacks]
        self.b = [rand(layers, slots, rank, s.out_features) for s in stacks]
        self.x = [rand(tokens, s.in_features) * 50 for s in stacks]
        self.y = [rand(layers, tokens, s.out_features) for s in stacks]
        self.scaling = torch.full((slots,), 2.0, dtype=dtype, device=device)
        self.slots = slots
        self.token_slots = torch.arange(tokens, device=device) % adapters

    def shuffle(self, seed: int) -> None:
        """Another order of the same rows (the step's layout, not its bytes)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        order = torch.randperm(self.token_slots.numel(), generator=gen).to(self.x[0].device)
        self.token_slots = self.token_slots[order]


def _ops(module: ModuleType, inp: Inputs) -> tuple[Callable[[], Any], Op]:
    """(the slot sort, one stack's launches for one layer); the sort's result is held in a cell
    the launches read (captured together, as a step's graph runs them)."""
    cell: dict[str, Any] = {}

    def sort() -> None:
        cell["seg"] = module.segments(inp.token_slots, inp.slots)

    def op(i: int, layer: int, shrink_only: bool) -> None:
        seg, stack = cell["seg"], inp.stacks[i]
        x, a, b, y = inp.x[i], inp.a[i][layer], inp.b[i][layer], inp.y[i][layer]
        shrunk = module.lora_shrink(x, a, inp.scaling, seg)
        if not shrink_only:
            module.lora_expand(shrunk, b, y, seg, stack.widths)

    return sort, op


def _time_ms(fn: Callable[[], None], device: torch.device) -> float:
    """Mean ms of fn as a CUDA graph replay (warmed up, compiled, outside the capture first);
    on the CPU one call's wall time."""
    if device.type != "cuda":
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1000.0
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    event = getattr(torch.cuda, "Event")  # noqa: B009 (untyped in some torch releases)
    start, end = event(enable_timing=True), event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / REPLAYS


def time_kernels(module: ModuleType, inp: Inputs, layers: int,
                 device: torch.device) -> dict[str, Any]:  # fmt: skip
    """Microseconds per layer: each stack's launches and its shrink alone, all stacks back to
    back; and the slot sort once."""
    sort, op = _ops(module, inp)

    def run(stacks: range, shrink_only: bool) -> Callable[[], None]:
        def body() -> None:
            sort()
            for layer in range(layers):
                for i in stacks:
                    op(i, layer, shrink_only)

        return body

    sort_ms = _time_ms(run(range(0), False), device)

    def per_layer(ms: float) -> float:
        return (ms - sort_ms) * 1000.0 / layers

    stacks: dict[str, dict[str, float]] = {}
    for i, stack in enumerate(inp.stacks):
        entry = {"us": per_layer(_time_ms(run(range(i, i + 1), False), device))}
        entry["shrink_us"] = per_layer(_time_ms(run(range(i, i + 1), True), device))
        entry["expand_us"] = entry["us"] - entry["shrink_us"]
        stacks["+".join(stack.projections)] = entry
    layer_us = per_layer(_time_ms(run(range(len(inp.stacks)), False), device))
    return {"sort_us": sort_ms * 1000.0, "layer_us": layer_us, "stacks": stacks}


def check_kernels(module: ModuleType, inp: Inputs) -> float:
    """Worst error of the kernels' deltas on layer 0 over the largest reference delta (rows of
    no adapter: none in these cases)."""
    sort, op = _ops(module, inp)
    sort()
    return _check(inp, op)


def _check(inp: Inputs, op: Op) -> float:
    worst = 0.0
    for i in range(len(inp.stacks)):
        inp.y[i][0].zero_()  # the delta alone (the timed replays added theirs)
        op(i, 0, False)
        got = inp.y[i][0].float()
        want = torch.zeros_like(got)
        for slot in torch.unique(inp.token_slots).tolist():
            rows = torch.nonzero(inp.token_slots == slot).squeeze(1)
            a, b = inp.a[i][0, slot].float(), inp.b[i][0, slot].float()
            rank = b.shape[0]
            shrunk = inp.x[i][rows].float() @ a * float(inp.scaling[slot])
            first = 0
            for j, width in enumerate(inp.stacks[i].widths):
                part = shrunk[:, j * rank : (j + 1) * rank]
                want[rows, first : first + width] = part @ b[:, first : first + width]
                first += width
        worst = max(worst, float((got - want).abs().amax() / want.abs().amax()))
    return worst


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_case(tokens: int, adapters: int, module: ModuleType, p: dict[str, Any],
             peak: float) -> dict[str, Any]:  # fmt: skip
    """One case: the kernels timed over SEEDS row orders, checked once, against the floor."""
    device, layers, rank = torch.device(p["device"]), LAYERS[p["preset"]], p["rank"]
    base = shapes_of(p["shape"], num_layers=layers)
    stacks = unique_stacks(base)
    inp = Inputs(stacks, layers, SLOTS[p["preset"]], rank, tokens, adapters, p["dtype"], device)
    element = torch.finfo(p["dtype"]).bits // 8
    floor = {s.name: s for s in (stack_bytes(st, rank, adapters, tokens, element) for st in stacks)}
    runs = []
    for seed in range(SEEDS[p["preset"]]):
        inp.shuffle(seed)
        runs.append(time_kernels(module, inp, layers, device))
    return {
        "tokens": tokens,
        "adapters": adapters,
        **_kernels_result(runs, floor, peak),
        "max_relative_error": check_kernels(module, inp),
        "floor_us_per_layer": sum(s.total for s in floor.values()) / peak * 1e6,
        "bytes_per_layer": {n: _bytes(s) for n, s in floor.items()},
    }


def _bytes(s: StackBytes) -> dict[str, int]:
    return {"shrink": s.shrink, "expand": s.expand, "total": s.total}


def _kernels_result(runs: list[dict[str, Any]], floor: dict[str, StackBytes],
                    peak: float) -> dict[str, Any]:  # fmt: skip
    """Medians and ranges over the seeds; each stack's achieved rate and fraction of peak."""
    stacks: dict[str, Any] = {}
    for name, bytes_ in floor.items():
        entry: dict[str, Any] = {}
        for key in runs[0]["stacks"][name]:
            entry[key] = _summary([r["stacks"][name][key] for r in runs])
        us = entry["us"]["median"]
        entry["bytes"] = bytes_.total
        entry["floor_us"] = bytes_.total / peak * 1e6
        entry["bytes_per_s"] = bytes_.total / (us * 1e-6) if us > 0 else None
        entry["bandwidth_fraction"] = bytes_.total / (us * 1e-6) / peak if us > 0 else None
        stacks[name] = entry
    layer = _summary([r["layer_us"] for r in runs])
    total = sum(s.total for s in floor.values())
    return {
        "sort_us": _summary([r["sort_us"] for r in runs]),
        "layer_us": layer,
        "layer_bandwidth_fraction": total / (layer["median"] * 1e-6) / peak
        if layer["median"] > 0
        else None,
        "stacks": stacks,
    }


def run(p: dict[str, Any]) -> dict[str, Any]:
    """Every case of the preset; the copy rate measured first."""
    device = torch.device(p["device"])
    peak_bytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    peak = float(measure_copy_bandwidth(device, peak_bytes)["read_write_bytes_per_s"])
    module = kernel_module(device)
    return {
        "peak_bytes_per_s": peak,
        "layers_timed": LAYERS[p["preset"]],
        "seeds": SEEDS[p["preset"]],
        "cases": {
            label: run_case(tokens, adapters, module, p, peak)
            for label, tokens, adapters in CASES[p["preset"]]
        },
    }


def report(result: dict[str, Any], model_layers: int) -> str:
    """The Markdown tables: per case, each stack's time per layer against the floor, then the
    whole layer's and a step's."""
    peak = result["peak_bytes_per_s"]
    lines = [
        "# LoRA kernels alone (cuda/lora_segmented.py; issues 69, 77)",
        "",
        f"Copy rate measured in this run: {peak / 1e12:.2f} TB/s (read + write). Times per "
        f"layer are medians of {result['seeds']} row orders (min-max), CUDA graph replays over "
        f"{result['layers_timed']} layers of distinct slot tensors; `floor` = bytes / copy rate.",
    ]
    for label, case in result["cases"].items():
        lines += ["", f"## {label}: {case['tokens']} rows over {case['adapters']} adapters", "",
                  "| stack | shrink us | expand us | stack us (min-max) | floor us | TB/s |"
                  " of peak |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for stack, e in case["stacks"].items():
            rate = (e["bytes_per_s"] or 0) / 1e12
            lines.append(
                f"| {stack} | {e['shrink_us']['median']:.1f} | {e['expand_us']['median']:.1f} | "
                f"{e['us']['median']:.1f} ({e['us']['min']:.1f}-{e['us']['max']:.1f}) | "
                f"{e['floor_us']:.1f} | {rate:.2f} | {e['bandwidth_fraction'] or 0:.2f} |"
            )
        layer = case["layer_us"]
        step_ms = (layer["median"] * model_layers + case["sort_us"]["median"]) / 1000.0
        floor_ms = case["floor_us_per_layer"] * model_layers / 1000.0
        lines += [
            "",
            f"Layer (all four stacks): {layer['median']:.1f} us ({layer['min']:.1f}-"
            f"{layer['max']:.1f}), {case['layer_bandwidth_fraction'] or 0:.2f} of peak; a step "
            f"of {model_layers} layers {step_ms:.3f} ms with the slot sort "
            f"({case['sort_us']['median']:.1f} us) against a {floor_ms:.3f} ms floor; max "
            f"relative error {case['max_relative_error']:.2e}.",
        ]
    return "\n".join(lines) + "\n"
