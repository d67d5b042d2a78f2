"""`python -m bench.engine.lora_kfold_gemm`: what issue 77's "expand folded into the base GEMM
along K" (bench/engine/lora_kfold_layout.py) would cost on the card, measured without building
it into the engine (bench/results/engine_lora/kfold_notes_77.md: the estimate says it cannot
meet the issue's goals; this checks the estimate's one modelled number).

For each stack of the 8B shape (rank 16, 64 slots), over `layers` layers of distinct weights (so
they stream from memory, not L2), as CUDA graph replays, per layer:
- the base GEMM (contiguous W), and through a K-prefix view of W_ext (lda > K: same time?);
- the extended GEMM over the first `used` slots' columns (a decode step of 256 rows over 8 and
  64 adapters, a prefill step of 2,048 over 8): its time over the base's is what the K-fold adds,
  against the model's base time x (used * n * R / in);
- the same with the stack's projections as separate GEMMs (no zero blocks; more launches);
- the engine's segmented shrink and expand (cuda/lora_segmented.py) for the same rows and slots:
  the K-fold replaces the expand, and keeps the shrink.
Checked on layer 0 (rows of no adapter among them): the extended GEMM against a float64
reference, rows of no adapter bit for bit against the base GEMM, the prefix against every slot's
columns, and whether torch copied a view (clone/copy ops during the GEMM).

    python -m bench.engine.lora_kfold_gemm [--results-dir DIR]   (one GPU, ~1-2 minutes)
    python -m bench.engine.lora_kfold_gemm --preset cpu   (a smoke run: tiny shapes, Triton's
                                                           interpreter, no timing worth reading)
"""

from __future__ import annotations

import argparse
import importlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from bench.common import command_line, results_dir, write_results
from bench.engine.lora_kfold_layout import (
    StackShape,
    ext_columns,
    extend_weight,
    fill_rows,
    kfold_linear,
    llama_stacks,
    reference,
    split_groups,
    write_slot,
)

PRESETS: dict[str, dict[str, Any]] = {
    "gpu": {
        "device": "cuda",
        "dtype": torch.bfloat16,
        "stacks": llama_stacks(4096, 4096, 1024, 14336),
        "rank": 16,
        "slots": 64,
        "layers": 8,
        "model_layers": 32,
        "cases": (("decode_8", 256, 8), ("decode_64", 256, 64), ("prefill_8", 2048, 8)),
        "replays": 20,
    },
    "cpu": {
        "device": "cpu",
        "dtype": torch.float32,
        "stacks": llama_stacks(64, 64, 16, 128),
        "rank": 4,
        "slots": 4,
        "layers": 2,
        "model_layers": 2,
        "cases": (("decode_2", 16, 2), ("decode_4", 16, 4)),
        "replays": 1,
    },
}
SEGMENTED = "site_engine.engine.cuda.lora_segmented"
Body = Callable[[], None]


def segmented_module(device: torch.device) -> ModuleType:
    if device.type == "cuda":
        return importlib.import_module(SEGMENTED)
    from devtools.triton_interpreter import interpreted_module

    return interpreted_module(SEGMENTED)


def time_ms(fn: Body, device: torch.device, replays: int) -> float:
    """Mean ms of fn as a CUDA graph replay (run once eagerly first: compiles, cuBLAS picks);
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
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    elapsed = float(start.elapsed_time(end)) / replays
    del graph
    return elapsed


class StackTensors:
    """One stack's weights for `layers` layers: W_ext at `slots` slots (every slot's B written
    block-diagonal), W (contiguous copy of the base columns), the slots' A and B as the engine
    stores them (for the segmented kernels)."""

    def __init__(self, stack: StackShape, p: dict[str, Any], device: torch.device) -> None:
        layers, slots, rank, dtype = p["layers"], p["slots"], p["rank"], p["dtype"]
        gen = torch.Generator(device=device).manual_seed(0)

        def rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
            out = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
            return (out * scale).to(dtype)

        self.stack, self.rank, self.slots = stack, rank, slots
        self.a = rand(layers, slots, stack.in_features, stack.n * rank)
        self.b = rand(layers, slots, rank, stack.out_features)
        self.w_ext = []
        for layer in range(layers):
            w_ext = extend_weight(rand(stack.out_features, stack.in_features), stack, rank, slots)
            for slot in range(slots):
                write_slot(w_ext, stack, rank, slot, self.b[layer, slot])
            self.w_ext.append(w_ext)
        self.w = [w[:, : stack.in_features].contiguous() for w in self.w_ext]
        self.scaling = torch.full((slots,), 2.0, dtype=dtype, device=device)


class Rows:
    """A step's rows for one stack: x, x_ext (x and the rows' s in their slots' columns)."""

    def __init__(self, t: StackTensors, token_slots: torch.Tensor, seed: int) -> None:
        stack, device, dtype = t.stack, t.a.device, t.a.dtype
        gen = torch.Generator(device=device).manual_seed(seed)
        tokens = token_slots.shape[0]
        self.token_slots = token_slots
        self.x = torch.randn(tokens, stack.in_features, generator=gen, device=device).to(dtype)
        self.shrunk = (torch.randn(tokens, stack.n * t.rank, generator=gen, device=device)).to(
            dtype
        )
        self.x_ext = torch.zeros(
            tokens, ext_columns(stack, t.rank, t.slots), dtype=dtype, device=device
        )
        self.x_ext[:, : stack.in_features] = self.x
        fill_rows(self.x_ext, stack, t.rank, self.shrunk, token_slots)
        self.y = torch.empty(tokens, stack.out_features, dtype=dtype, device=device)


def _bodies(t: StackTensors, r: Rows, used: int, seg: ModuleType) -> dict[str, Body]:
    """Each timed variant's body over all layers."""
    stack, rank, in_f = t.stack, t.rank, t.stack.in_features
    k_ext, groups = ext_columns(stack, rank, used), split_groups(stack, rank, used)
    layers = range(len(t.w))
    cell: dict[str, Any] = {}

    def gemms(x: torch.Tensor, weights: Sequence[torch.Tensor], k: int | None) -> Body:
        def body() -> None:
            for w in weights:
                lhs, rhs = (x, w) if k is None else (x[:, :k], w[:, :k])
                torch.mm(lhs, rhs.T, out=r.y)

        return body

    def split(x: torch.Tensor, weights: Sequence[torch.Tensor], extended: bool) -> Body:
        """The split layout's GEMMs, each into its columns of y (a view, as silu_mul would read
        gate | up); timed over x_ext's first K columns (the real layout's window has the same
        shape and strides)."""

        def body() -> None:
            for w in weights:
                for lo, hi, k in groups:
                    lhs, rhs = (x[:, :k], w[lo:hi, :k]) if extended else (x, w[lo:hi])
                    torch.mm(lhs, rhs.T, out=r.y[:, lo:hi])

        return body

    def segmented(kernels: str) -> Body:
        """The slot sort once, then per layer nothing, the shrink, or the shrink and expand."""

        def body() -> None:
            cell["seg"] = seg.segments(r.token_slots, t.slots)
            for layer in layers if kernels != "sort" else ():
                shrunk = seg.lora_shrink(r.x, t.a[layer], t.scaling, cell["seg"])
                if kernels == "both":
                    seg.lora_expand(shrunk, t.b[layer], r.y, cell["seg"], stack.widths)

        return body

    bodies = {
        "base": gemms(r.x, t.w, None),
        "view": gemms(r.x_ext, t.w_ext, in_f),
        "ext": gemms(r.x_ext, t.w_ext, k_ext),
        "sort": segmented("sort"),
        "shrink": segmented("shrink"),
        "segmented": segmented("both"),
    }
    if stack.n > 1:
        bodies["split_base"] = split(r.x, t.w, False)
        bodies["split_ext"] = split(r.x_ext, t.w_ext, True)
    return bodies


def time_stack(t: StackTensors, tokens: int, used: int, p: dict[str, Any], seg: ModuleType,
               device: torch.device) -> dict[str, float]:  # fmt: skip
    """Microseconds per layer of each variant, and the derived figures."""
    token_slots = torch.arange(tokens, device=device) % used
    r = Rows(t, token_slots, seed=1)
    bodies = _bodies(t, r, used, seg)
    ms = {name: time_ms(body, device, p["replays"]) for name, body in bodies.items()}
    layers = len(t.w)
    us = {name: v * 1000.0 / layers for name, v in ms.items() if name != "sort"}
    for name in ("shrink", "segmented"):
        us[name] -= ms["sort"] * 1000.0 / layers
    stack, rank = t.stack, t.rank
    out = {
        **us,
        "sort_us": ms["sort"] * 1000.0,
        "delta_us": us["ext"] - us["base"],
        "predicted_delta_us": us["base"] * used * stack.n * rank / stack.in_features,
        "expand_us": us["segmented"] - us["shrink"],
    }
    out["split_delta_us"], out["split_predicted_delta_us"] = out["delta_us"], 0.0
    if "split_ext" in us:
        out["split_delta_us"] = us["split_ext"] - us["base"]
    for lo, hi, k in split_groups(stack, rank, used):
        share = (hi - lo) / stack.out_features * (k - stack.in_features) / stack.in_features
        out["split_predicted_delta_us"] += us["base"] * share
    out["kfold_saving_us"] = out["expand_us"] - out["delta_us"]
    out["split_saving_us"] = out["expand_us"] - out["split_delta_us"]
    return out


def check_stack(t: StackTensors, tokens: int, used: int) -> dict[str, Any]:
    """Layer 0, a quarter of the rows without an adapter: the extended GEMM against float64,
    base rows bit for bit, the prefix against all slots' columns, copies of the views."""
    device = t.a.device
    token_slots = torch.arange(tokens, device=device) % used
    token_slots[: tokens // 4] = -1
    r = Rows(t, token_slots, seed=2)
    w_ext, w, stack, rank = t.w_ext[0], t.w[0], t.stack, t.rank
    got = kfold_linear(r.x_ext, w_ext, stack, rank, used)
    full = kfold_linear(r.x_ext, w_ext, stack, rank, t.slots)
    want = reference(r.x, w, stack, r.shrunk, t.b[0], token_slots)
    base_rows = token_slots < 0
    base = torch.mm(r.x, w.T)
    view = kfold_linear(r.x_ext, w_ext, stack, rank, 0)
    with torch.profiler.profile() as prof:
        kfold_linear(r.x_ext, w_ext, stack, rank, used)
    names = sorted({e.name for e in prof.events()})
    # The split layout's GEMMs write their column ranges of one output (views as out=).
    split_out = torch.empty_like(got)
    with torch.profiler.profile() as prof:
        for lo, hi, k in split_groups(stack, rank, used):
            torch.mm(r.x_ext[:, :k], w_ext[lo:hi, :k].T, out=split_out[:, lo:hi])
    split_names = sorted({e.name for e in prof.events()})
    split_same = all(
        torch.equal(split_out[:, lo:hi], torch.mm(r.x_ext[:, :k], w_ext[lo:hi, :k].T))
        for lo, hi, k in split_groups(stack, rank, used)
    )
    return {
        "max_relative_error": float((got.double() - want).abs().amax() / want.abs().amax()),
        "base_rows_bit_identical_to_base_gemm": bool(torch.equal(got[base_rows], base[base_rows])),
        "base_rows_max_abs_diff": float((got[base_rows] - base[base_rows]).abs().amax()),
        "view_bit_identical_to_base_gemm": bool(torch.equal(view, base)),
        "prefix_bit_identical_to_all_slots": bool(torch.equal(got, full)),
        "prefix_max_abs_diff": float((got - full).abs().amax()),
        "copies_in_gemm": _copies(names),
        "copies_in_split_gemms": _copies(split_names),
        "split_out_views_equal_fresh_gemms": split_same,
    }


def _copies(names: Sequence[str]) -> list[str]:
    """Ops or kernels that copy (torch's prepare_matrix_for_cublas clones what cuBLAS cannot
    take as a leading dimension)."""
    return [n for n in names if any(s in n for s in ("clone", "copy", "contig"))]


def run(p: dict[str, Any]) -> dict[str, Any]:
    device = torch.device(p["device"])
    seg = segmented_module(device)
    cases: dict[str, Any] = {
        label: {"tokens": tokens, "adapters": used, "stacks": {}}
        for label, tokens, used in p["cases"]
    }
    checks: dict[str, Any] = {}
    for stack in p["stacks"]:
        t = StackTensors(stack, p, device)
        print(f"{stack.name}: weights built", flush=True)
        for label, tokens, used in p["cases"]:
            cases[label]["stacks"][stack.name] = time_stack(t, tokens, used, p, seg, device)
            print(f"{stack.name} {label}: {cases[label]['stacks'][stack.name]}", flush=True)
        _, tokens, used = p["cases"][0]
        checks[stack.name] = check_stack(t, tokens, used)
        print(f"{stack.name} checks: {checks[stack.name]}", flush=True)
        del t
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for case in cases.values():
        case["step_ms"] = {
            key: sum(s[key] for s in case["stacks"].values()) * p["model_layers"] / 1000.0
            for key in ("base", "delta_us", "predicted_delta_us", "split_delta_us",
                        "split_predicted_delta_us", "shrink", "expand_us", "kfold_saving_us",
                        "split_saving_us")
        }  # fmt: skip
    return {
        "rank": p["rank"],
        "slots": p["slots"],
        "layers_timed": p["layers"],
        "model_layers": p["model_layers"],
        "cases": cases,
        "checks": checks,
    }


def report(result: dict[str, Any]) -> str:
    lines = [
        "# Issue 77's K-fold layout on the card (bench/engine/lora_kfold_layout.py)",
        "",
        f"Per layer, us (CUDA graph replays over {result['layers_timed']} layers of distinct "
        f"weights; rank {result['rank']}, {result['slots']} slots). `base`: the stack's GEMM; "
        "`view`: the same through W_ext's first `in` columns; `+ fused`: the extended GEMM "
        "over the used slots' block-diagonal columns minus `base` (what the K-fold adds), "
        "`model` = base x used x n x R / in; `+ split`: q | k+v and gate | up as two extended "
        "GEMMs each (no zero blocks but k+v's) minus `base`, and its model; `shrink`, "
        "`expand`: the segmented kernels for the same rows (the K-fold replaces the expand); "
        "`saving` = expand - the K-fold's addition, fused / split.",
    ]
    for label, case in result["cases"].items():
        lines += ["", f"## {label}: {case['tokens']} rows over {case['adapters']} adapters", "",
                  "| stack | base | view | + fused (model) | + split (model) | shrink | expand |"
                  " saving fused / split |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, s in case["stacks"].items():
            lines.append(
                f"| {name} | {s['base']:.1f} | {s['view']:.1f} | {s['delta_us']:.1f} "
                f"({s['predicted_delta_us']:.1f}) | {s['split_delta_us']:.1f} "
                f"({s['split_predicted_delta_us']:.1f}) | {s['shrink']:.1f} | "
                f"{s['expand_us']:.1f} | {s['kfold_saving_us']:.1f} / {s['split_saving_us']:.1f} |"
            )
        st = case["step_ms"]
        lines += [
            "",
            f"A step of {result['model_layers']} layers: base GEMMs {st['base']:.3f} ms; the "
            f"K-fold adds {st['delta_us']:.3f} ms fused (model {st['predicted_delta_us']:.3f}), "
            f"{st['split_delta_us']:.3f} split (model {st['split_predicted_delta_us']:.3f}), "
            f"where the segmented expand takes {st['expand_us']:.3f} (shrink "
            f"{st['shrink']:.3f}): **saving {st['kfold_saving_us']:.3f} ms a step fused, "
            f"{st['split_saving_us']:.3f} split**.",
        ]
    lines += [
        "",
        "## Checks (layer 0, the first case, a quarter of the rows without an adapter)",
        "",
        "| stack | rel err | base rows bitwise (max diff) | view bitwise | prefix bitwise (max "
        "diff) | split outs = fresh | copies fused / split |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, c in result["checks"].items():
        copies = f"{', '.join(c['copies_in_gemm']) or 'none'} / "
        copies += ", ".join(c["copies_in_split_gemms"]) or "none"
        lines.append(
            f"| {name} | {c['max_relative_error']:.1e} | "
            f"{c['base_rows_bit_identical_to_base_gemm']} ({c['base_rows_max_abs_diff']:.1e}) | "
            f"{c['view_bit_identical_to_base_gemm']} | {c['prefix_bit_identical_to_all_slots']} "
            f"({c['prefix_max_abs_diff']:.1e}) | {c['split_out_views_equal_fresh_gemms']} | "
            f"{copies} |"
        )
    return "\n".join(lines) + "\n"


def device_label(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return next((card for card in ("h200", "h100", "a100") if card in name), "gpu")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    p = PRESETS[args.preset]
    device = torch.device(p["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("lora_kfold_gemm: the gpu preset needs CUDA (use --preset cpu here)")
    result = run(p)
    text = report(result)
    print(text, flush=True)
    write_results(
        f"lora_kfold_{device_label(device)}",
        result,
        text,
        command_line("bench.engine.lora_kfold_gemm", argv),
        args.results_dir or results_dir("engine_lora"),
    )


if __name__ == "__main__":
    main()
