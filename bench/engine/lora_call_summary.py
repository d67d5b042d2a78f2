"""`python -m bench.engine.lora_call_summary DIR`: the short table that ends issue 77's GPU call
(bench/engine/lora_gpu_call.sh), from the results it wrote into DIR: the kernels alone
(lora_kernels_<card>.json: each variant's ms a step of 32 layers, decode and prefill, its error)
and the engine (lora_profile_<card>_<path>.json: step_vs_base, the LoRA kernels' bandwidth
fraction and their ms a step, by adapters in the step). What decides which kernel path stays.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

LAYERS = 32  # the 8B shape's


def kernels_table(result: dict[str, Any]) -> list[str]:
    cases = result["cases"]
    labels = list(cases)
    lines = [
        f"kernels alone, ms a step of {LAYERS} layers (slot sort included), copy rate "
        f"{result['peak_bytes_per_s'] / 1e12:.2f} TB/s; best split-K: {result['best_variant']} "
        f"{result['best_tuning']}",
        "variant        " + "".join(f"{label:>11}" for label in labels) + "  frac(d8,d64)  err",
    ]
    floor = "floor          " + "".join(
        f"{cases[label]['floor_us_per_layer'] * LAYERS / 1000:>11.3f}" for label in labels
    )
    variants = list(next(iter(cases.values()))["variants"])
    for name in variants:
        row, fracs, errors = f"{name:<15}", [], []
        for label in labels:
            var = cases[label]["variants"].get(name, {})
            if "failed" in var or "layer_us" not in var:
                row += f"{'failed':>11}"
                continue
            ms = (var["layer_us"]["median"] * LAYERS + var["sort_us"]["median"]) / 1000
            row += f"{ms:>11.3f}"
            errors.append(var["max_relative_error"])
            if label.startswith("decode"):
                fracs.append(f"{var['layer_bandwidth_fraction'] or 0:.2f}")
        lines.append(row + f"  {','.join(fracs):>12}  {max(errors, default=0):.1e}")
    return [*lines, floor]


def profile_table(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "engine decode step (256 rows, 8B shape): step_vs_base / LoRA kernels' fraction of "
        "the copy rate (ms a step)",
        "path        adapters  step_vs_base  frac  lora ms  shrink ms  expand ms  no-adapter",
    ]
    for path, r in results.items():
        for adapters, ratio in sorted(r["step_vs_base"].items(), key=lambda kv: int(kv[0])):
            arm = r["lora"] if adapters == str(r["adapters"]) else r[f"lora_{adapters}"]
            groups = arm["groups"]
            shrink = groups.get("lora_shrink", {}).get("us_per_step", 0) / 1000
            expand = groups.get("lora_expand", {}).get("us_per_step", 0) / 1000
            band = r["lora_kernel_bandwidth"][adapters]
            frac = band["fraction"] or 0
            lines.append(
                f"{path:<12}{adapters:>8}  {ratio:>12.3f}  {frac:.2f}  "
                f"{band['kernel_us_per_step'] / 1000:>7.2f}  {shrink:>9.2f}  {expand:>9.2f}  "
                f"{r['steps_vs_base']['lora_no_adapter_rows']:>10.3f}"
            )
        if r.get("lora_tuning"):
            lines.append(f"{'':<12}tuning {r['lora_tuning']}")
    return lines


def main(argv: list[str] | None = None) -> None:
    folder = Path((argv if argv is not None else sys.argv[1:])[0])
    lines: list[str] = []
    for path in sorted(folder.glob("lora_kernels_*.json")):
        lines += [*kernels_table(json.loads(path.read_text())), ""]
    loaded = [json.loads(p.read_text()) for p in sorted(folder.glob("lora_profile_*.json"))]
    profiles = {r["lora_kernels"]: r for r in loaded}
    if profiles:
        lines += profile_table(profiles)
    print("\n".join(lines) if lines else f"no LoRA results in {folder}")


if __name__ == "__main__":
    main()
