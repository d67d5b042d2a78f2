"""`python -m bench.engine.lora_profile --kernels-only`: the multi-LoRA kernels alone, both of the
engine's kernel paths (LoraSettings.kernels) and variants of the split-K path's tunables on the
same inputs, against the bytes they must move (issues 69, 77).

For the 8B shape at rank 16 on all seven projections (64 slots), a decode step of 256 rows over
8 and over 64 adapters and a prefill step of 2,048 rows over 8, each stack's kernels run over
`LAYERS` layers of distinct slot tensors (1.3 GB at 64 adapters: the weights stream from memory
as in the engine, not from L2). Variants (`VARIANTS`):

- `segmented`: cuda/lora_segmented.py, the engine's default path;
- `splitk`: cuda/lora_splitk.py with its module defaults (issue 77);
- `splitk_<knob>`: the same with one planning constant changed (tile rows at decode, PDL, the
  splits' cap, block sizes, the grids): a choice to make from this run, not what the engine runs;
- `splitk_best`: every knob at its best single variant's value (decode cases), if that is a
  combination no single variant timed.

`best_tuning` in the results: the settings of the fastest split-K variant on the decode cases
(8 and 64 adapters, summed), whose prefill time is within 10% of the default's; what
`python -m bench.engine.lora_profile --lora-tuning-from <this json>` runs the engine with, and
what the module's constants should become if the path wins.

Each is timed as CUDA graph replays (the slot sort once, then the layers' launches, as a step's
graph runs them), so launch gaps count as they do in the engine: per stack and layer the
shrink's time (the two default variants), the whole stack's, and all four stacks of a layer
back to back. Bytes per stack are bench/engine/lora_bytes.py's floor (A and B of the slots in
use, the rows' inputs once and outputs read and written); achieved rate = bytes / time, and its
fraction of the card's copy rate measured in the same run. `SEEDS` row orders: median and
min-max. Each variant's deltas are checked against a float32 PyTorch reference on layer 0.

On the CPU (`--preset cpu`) the same code runs a tiny shape through Triton's interpreter (three
variants): a smoke run of the script, no timing worth reading.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

from bench.engine.lora_bytes import StackBytes, shapes_of, stack_bytes, unique_stacks
from bench.engine.roofline import measure_copy_bandwidth
from site_engine.engine.lora.segmented_step import LoraKernels
from site_engine.engine.lora.slots import Stack

CASES = {
    "gpu": (("decode_8", 256, 8), ("decode_64", 256, 64), ("prefill_8", 2048, 8)),
    "cpu": (("decode_4", 16, 4), ("prefill_2", 520, 2)),
}
LAYERS = {"gpu": 8, "cpu": 2}
SLOTS = {"gpu": 64, "cpu": 4}
SEEDS = {"gpu": 2, "cpu": 1}  # row orders timed (the CPU run is a smoke run)
REPLAYS = 20
Op = Callable[[int, int, bool], None]  # (stack index, layer, shrink only) -> None
MODULES: dict[LoraKernels, str] = {
    "segmented": "site_engine.engine.cuda.lora_segmented",
    "splitk": "site_engine.engine.cuda.lora_splitk",
}
# name -> (kernel path, its module's planning constants changed for the variant). The knobs of
# one group are alternatives (the default's value is the group's other member).
VARIANTS: dict[str, tuple[LoraKernels, dict[str, int | bool]]] = {
    "segmented": ("segmented", {}),
    "splitk": ("splitk", {}),
    "splitk_m16": ("splitk", {"_DECODE_TILE_ROWS": 16}),
    "splitk_m64": ("splitk", {"_DECODE_TILE_ROWS": 64}),
    "splitk_pdl": ("splitk", {"_PDL": True}),
    "splitk_s8": ("splitk", {"_MAX_SPLITS": 8}),
    "splitk_n128": ("splitk", {"_BLOCK_N": 128}),
    "splitk_sp1024": ("splitk", {"_SHRINK_PROGRAMS": 1024}),
    "splitk_ep512": ("splitk", {"_EXPAND_PROGRAMS": 512}),
    "splitk_ep2048": ("splitk", {"_EXPAND_PROGRAMS": 2048}),
}
CPU_VARIANTS = ("segmented", "splitk", "splitk_m16")
SHRINK_TIMED = ("segmented", "splitk")  # the variants whose shrink is timed alone too
PREFILL_SLACK = 1.10  # a tuning may cost prefill at most this over the default's
MAX_ERROR = 3e-2  # a variant whose deltas are further off than bf16 rounding is no candidate


def kernel_module(path: LoraKernels, device: torch.device) -> ModuleType:
    """A kernel path's module: imported on CUDA, an interpreted copy on the CPU."""
    import importlib

    if device.type == "cuda":
        return importlib.import_module(MODULES[path])
    from devtools.triton_interpreter import interpreted_module

    return interpreted_module(MODULES[path])


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


def _ops(path: LoraKernels, module: ModuleType, inp: Inputs) -> tuple[Callable[[], Any], Op]:
    """(the slot sort, one stack's launches for one layer) of a kernel path; the sort's result
    is held in a cell the launches read (captured together, as a step's graph runs them)."""
    cell: dict[str, Any] = {}

    def sort() -> None:
        cell["seg"] = module.segments(inp.token_slots, inp.slots)
        if path == "splitk":
            cell["counts"] = torch.zeros(cell["seg"].tiles, dtype=torch.int32,
                                         device=inp.x[0].device)  # fmt: skip

    def op(i: int, layer: int, shrink_only: bool) -> None:
        seg, stack = cell["seg"], inp.stacks[i]
        x, a, b, y = inp.x[i], inp.a[i][layer], inp.b[i][layer], inp.y[i][layer]
        if path == "splitk":
            shrunk = module.lora_shrink(x, a, inp.scaling, seg, cell["counts"])
        else:
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


@contextlib.contextmanager
def settings(changes: dict[str, Any], module: ModuleType) -> Iterator[None]:
    """A kernel module's planning constants set to `changes` while open: a variant's while it
    is captured and checked (they only shape launch arguments, read at each launch)."""
    before = {key: getattr(module, key) for key in changes}
    for key, value in changes.items():
        setattr(module, key, value)
    try:
        yield
    finally:
        for key, value in before.items():
            setattr(module, key, value)


def time_variant(path: LoraKernels, changes: dict[str, int | bool], module: ModuleType,
                 inp: Inputs, layers: int, device: torch.device,
                 shrink_timed: bool) -> dict[str, Any]:  # fmt: skip
    """Microseconds per layer: each stack's launches (and its shrink alone if `shrink_timed`),
    all stacks back to back; and the slot sort once."""
    with settings(changes, module):
        return _time_variant(path, module, inp, layers, device, shrink_timed)


def _time_variant(path: LoraKernels, module: ModuleType, inp: Inputs, layers: int,
                  device: torch.device, shrink_timed: bool) -> dict[str, Any]:  # fmt: skip
    sort, op = _ops(path, module, inp)

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
        if shrink_timed:
            entry["shrink_us"] = per_layer(_time_ms(run(range(i, i + 1), True), device))
            entry["expand_us"] = entry["us"] - entry["shrink_us"]
        stacks["+".join(stack.projections)] = entry
    layer_us = per_layer(_time_ms(run(range(len(inp.stacks)), False), device))
    return {"sort_us": sort_ms * 1000.0, "layer_us": layer_us, "stacks": stacks}


def check_variant(path: LoraKernels, changes: dict[str, int | bool], module: ModuleType,
                  inp: Inputs) -> float:  # fmt: skip
    """Worst error of a variant's deltas on layer 0 over the largest reference delta (rows of
    no adapter: none in these cases)."""
    sort, op = _ops(path, module, inp)
    with settings(changes, module):
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


Variant = tuple[LoraKernels, dict[str, int | bool], ModuleType]


def run_case(label: str, tokens: int, adapters: int, variants: dict[str, Variant],
             p: dict[str, Any], peak: float) -> dict[str, Any]:  # fmt: skip
    """One case: every variant timed over SEEDS row orders, checked once, against the floor."""
    device, layers, rank = torch.device(p["device"]), LAYERS[p["preset"]], p["rank"]
    base = shapes_of(p["shape"], num_layers=layers)
    stacks = unique_stacks(base)
    inp = Inputs(stacks, layers, SLOTS[p["preset"]], rank, tokens, adapters, p["dtype"], device)
    element = torch.finfo(p["dtype"]).bits // 8
    floor = {s.name: s for s in (stack_bytes(st, rank, adapters, tokens, element) for st in stacks)}
    out: dict[str, Any] = {"tokens": tokens, "adapters": adapters, "variants": {}}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    failed: dict[str, str] = {}
    for seed in range(SEEDS[p["preset"]]):
        inp.shuffle(seed)
        for name, (path, changes, module) in variants.items():
            if name in failed:
                continue
            try:
                runs[name].append(time_variant(path, changes, module, inp, layers, device,
                                               name in SHRINK_TIMED))  # fmt: skip
            except Exception as error:  # one variant's failure is its result, not the run's
                failed[name] = f"{type(error).__name__}: {error}"[:300]
    for name, (path, changes, module) in variants.items():
        if name in failed:
            out["variants"][name] = {"failed": failed[name]}
            continue
        out["variants"][name] = _variant_result(runs[name], floor, peak)
        try:
            worst = check_variant(path, changes, module, inp)
        except Exception as failure:
            out["variants"][name] = {"failed": f"check: {type(failure).__name__}: {failure}"}
            continue
        out["variants"][name]["max_relative_error"] = worst
    out["floor_us_per_layer"] = sum(s.total for s in floor.values()) / peak * 1e6
    out["bytes_per_layer"] = {n: _bytes(s) for n, s in floor.items()}
    return out


def _bytes(s: StackBytes) -> dict[str, int]:
    return {"shrink": s.shrink, "expand": s.expand, "total": s.total}


def _variant_result(runs: list[dict[str, Any]], floor: dict[str, StackBytes],
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


def _layer_us(cases: dict[str, Any], name: str, prefix: str) -> float:
    """A variant's layer times on the cases whose label starts with `prefix`, summed (inf if
    it failed or was not run, or got the deltas wrong)."""
    total = 0.0
    for label, case in cases.items():
        var = case["variants"].get(name, {})
        if not label.startswith(prefix):
            continue
        if "failed" in var or "layer_us" not in var or var["max_relative_error"] > MAX_ERROR:
            return float("inf")
        total += var["layer_us"]["median"]
    return total


def _decode_us(cases: dict[str, Any], name: str) -> float:
    """A variant's score: its layer times on the decode cases, summed."""
    return _layer_us(cases, name, "decode")


def _prefill_us(cases: dict[str, Any], name: str) -> float:
    return _layer_us(cases, name, "prefill")


def _combined(cases: dict[str, Any], names: list[str]) -> dict[str, int | bool]:
    """Each knob at the value of its best single split-K variant (decode score), the default's
    where no variant of the knob beat it."""
    best: dict[str, tuple[float, int | bool]] = {}
    for name in names:
        changes = VARIANTS[name][1]
        if len(changes) != 1:
            continue
        ((knob, value),) = changes.items()
        score = _decode_us(cases, name)
        if score < _decode_us(cases, "splitk") and score < best.get(knob, (float("inf"), 0))[0]:
            best[knob] = (score, value)
    return {knob: value for knob, (_, value) in best.items()}


def best_tuning(cases: dict[str, Any], settings: dict[str, dict[str, int | bool]]) -> str:
    """The fastest split-K variant on the decode cases whose prefill stays within PREFILL_SLACK
    of the default's (the default itself otherwise)."""
    limit = _prefill_us(cases, "splitk") * PREFILL_SLACK
    names = [n for n in settings if n.startswith("splitk") and _prefill_us(cases, n) <= limit]
    return min(names or ["splitk"], key=lambda n: _decode_us(cases, n))


def run(p: dict[str, Any]) -> dict[str, Any]:
    """Every case of the preset, every variant; the copy rate measured first; then the knobs'
    best values combined, timed if no single variant was that combination, and the best."""
    device = torch.device(p["device"])
    peak_bytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    peak = float(measure_copy_bandwidth(device, peak_bytes)["read_write_bytes_per_s"])
    modules = {path: kernel_module(path, device) for path in MODULES}
    names = list(VARIANTS) if device.type == "cuda" else list(CPU_VARIANTS)
    settings = {name: VARIANTS[name][1] for name in names}

    def variants(chosen: dict[str, dict[str, int | bool]]) -> dict[str, Variant]:
        return {n: (VARIANTS[n][0] if n in VARIANTS else "splitk", c,
                    modules[VARIANTS[n][0] if n in VARIANTS else "splitk"])
                for n, c in chosen.items()}  # fmt: skip

    cases = {
        label: run_case(label, tokens, adapters, variants(settings), p, peak)
        for label, tokens, adapters in CASES[p["preset"]]
    }
    combined = _combined(cases, [n for n in names if n.startswith("splitk_")])
    if len(combined) > 1:  # a combination no single variant timed
        settings["splitk_best"] = combined
        for label, tokens, adapters in CASES[p["preset"]]:
            extra = run_case(label, tokens, adapters, variants({"splitk_best": combined}), p,
                             peak)  # fmt: skip
            cases[label]["variants"]["splitk_best"] = extra["variants"]["splitk_best"]
    best = best_tuning(cases, settings)
    return {
        "peak_bytes_per_s": peak,
        "layers_timed": LAYERS[p["preset"]],
        "seeds": SEEDS[p["preset"]],
        "settings": settings,
        "best_variant": best,
        "best_tuning": settings[best],
        "cases": cases,
    }


def report(result: dict[str, Any], model_layers: int) -> str:
    """The Markdown tables: per case, each variant's per-layer time by stack against the floor."""
    peak = result["peak_bytes_per_s"]
    lines = [
        "# LoRA kernels alone (issues 69, 77)",
        "",
        f"Copy rate measured in this run: {peak / 1e12:.2f} TB/s (read + write). Times per "
        f"layer are medians of {result['seeds']} row orders (min-max), CUDA graph replays over "
        f"{result['layers_timed']} layers of distinct slot tensors; `floor` = bytes / copy rate.",
        "Variants: `segmented` (cuda/lora_segmented.py, the engine's default path), `splitk` "
        "(cuda/lora_splitk.py, issue 77) and `splitk_*`, the split-K path with these of its "
        "module's constants changed: "
        + "; ".join(f"`{n}` {c}" for n, c in result["settings"].items() if c),
        "",
        f"Best split-K tuning (decode cases, prefill within {PREFILL_SLACK:.2f}x of the "
        f"default's): **{result['best_variant']}** {result['best_tuning']}",
    ]
    for label, case in result["cases"].items():
        lines += ["", f"## {label}: {case['tokens']} rows over {case['adapters']} adapters", "",
                  "| variant | stack | shrink us | expand us | stack us (min-max) | floor us |"
                  " TB/s | of peak |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, var in case["variants"].items():
            if "failed" in var:
                lines.append(f"| {name} | failed: {var['failed'][:120]} | | | | | | |")
                continue
            for stack, e in var["stacks"].items():
                shrink = f"{e['shrink_us']['median']:.1f}" if "shrink_us" in e else "-"
                expand = f"{e['expand_us']['median']:.1f}" if "expand_us" in e else "-"
                rate = (e["bytes_per_s"] or 0) / 1e12
                lines.append(
                    f"| {name} | {stack} | {shrink} | {expand} | {e['us']['median']:.1f} "
                    f"({e['us']['min']:.1f}-{e['us']['max']:.1f}) | {e['floor_us']:.1f} | "
                    f"{rate:.2f} | {e['bandwidth_fraction'] or 0:.2f} |"
                )
        lines += ["", "| variant | layer us (min-max) | ms a step of "
                  f"{model_layers} layers | of peak | slot sort us | max rel. error |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for name, var in case["variants"].items():
            if "failed" in var:
                continue
            layer = var["layer_us"]
            step_ms = (layer["median"] * model_layers + var["sort_us"]["median"]) / 1000.0
            lines.append(
                f"| {name} | {layer['median']:.1f} ({layer['min']:.1f}-{layer['max']:.1f}) | "
                f"{step_ms:.3f} | {var['layer_bandwidth_fraction'] or 0:.2f} | "
                f"{var['sort_us']['median']:.1f} | {var['max_relative_error']:.2e} |"
            )
        lines.append(f"\nFloor: {case['floor_us_per_layer']:.1f} us a layer.")
    return "\n".join(lines) + "\n"
