"""`python -m bench.engine.lora_call_summary DIR`: the short table that ends the LoRA GPU call
(bench/engine/lora_gpu_call.sh), from the results it wrote into DIR: the kernels alone
(lora_kernels_<card>.json: ms a step of 32 layers by case, against the bytes floor) and the
engine (lora_profile_<card>.json: step_vs_base, the LoRA kernels' bandwidth fraction and their
ms a step, by adapters in the step): issue 77's figures, in the output's tail.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

LAYERS = 32  # the 8B shape's


def kernels_table(result: dict[str, Any]) -> list[str]:
    lines = [
        f"kernels alone, ms a step of {LAYERS} layers (slot sort included), copy rate "
        f"{result['peak_bytes_per_s'] / 1e12:.2f} TB/s",
        "case          rows  adapters      ms  floor ms  of peak      err",
    ]
    for label, case in result["cases"].items():
        ms = (case["layer_us"]["median"] * LAYERS + case["sort_us"]["median"]) / 1000
        floor = case["floor_us_per_layer"] * LAYERS / 1000
        lines.append(
            f"{label:<12}{case['tokens']:>6}  {case['adapters']:>8}  {ms:>6.3f}  {floor:>8.3f}  "
            f"{case['layer_bandwidth_fraction'] or 0:>7.2f}  {case['max_relative_error']:.1e}"
        )
    return lines


def profile_table(r: dict[str, Any]) -> list[str]:
    lines = [
        f"engine decode step ({r['rows']} rows, 8B shape): step_vs_base / LoRA kernels' fraction "
        f"of the {r['copy_bytes_per_s'] / 1e12:.2f} TB/s copy rate (ms a step)",
        "adapters  step_vs_base  frac  lora ms  shrink ms  expand ms  no-adapter",
    ]
    for adapters, ratio in sorted(r["step_vs_base"].items(), key=lambda kv: int(kv[0])):
        arm = r["lora"] if adapters == str(r["adapters"]) else r[f"lora_{adapters}"]
        groups = arm["groups"]
        shrink = groups.get("lora_shrink", {}).get("us_per_step", 0) / 1000
        expand = groups.get("lora_expand", {}).get("us_per_step", 0) / 1000
        band = r["lora_kernel_bandwidth"][adapters]
        lines.append(
            f"{adapters:>8}  {ratio:>12.3f}  {band['fraction'] or 0:.2f}  "
            f"{band['kernel_us_per_step'] / 1000:>7.2f}  {shrink:>9.2f}  {expand:>9.2f}  "
            f"{r['steps_vs_base']['lora_no_adapter_rows']:>10.3f}"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    folder = Path((argv if argv is not None else sys.argv[1:])[0])
    lines: list[str] = []
    for path in sorted(folder.glob("lora_kernels_*.json")):
        lines += [*kernels_table(json.loads(path.read_text())), ""]
    for path in sorted(folder.glob("lora_profile_*.json")):
        lines += [*profile_table(json.loads(path.read_text())), ""]
    print("\n".join(lines).rstrip() if lines else f"no LoRA results in {folder}")


if __name__ == "__main__":
    main()
