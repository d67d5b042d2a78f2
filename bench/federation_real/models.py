"""The sites' models: random Llamas of the preset's shapes (bench/engine/model_setup.py), saved
with the tokenizer like a user's model directory and loaded by each site through the normal path.
Each shape is built once a work directory (reused when it is there); on the GPU every shape is
built at once, each by a process of its own on a GPU of its own (the 8B takes about a minute).

    python -m bench.federation_real.models --shape llama8b --out DIR --tokenizer-dir T \
        --device cuda:0
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.federation_real.presets import SHAPES, Preset


def model_dir(work_dir: Path, shape: str) -> Path:
    return work_dir / "models" / shape


def ensure_models(preset: Preset, work_dir: Path, tokenizer_dir: Path) -> dict[str, Path]:
    """Every shape the preset's sites serve: {shape: directory}."""
    devices: dict[str, str] = {}
    for site in preset.sites:
        devices.setdefault(site.shape, "cpu" if site.gpu is None else f"cuda:{site.gpu}")
    wanted = {shape: model_dir(work_dir, shape) for shape in devices}
    builds = []
    for shape, out in wanted.items():
        if (out / "config.json").is_file():
            continue
        args = [sys.executable, "-m", "bench.federation_real.models", "--shape", shape,
                "--out", str(out), "--tokenizer-dir", str(tokenizer_dir), "--dtype", preset.dtype,
                "--device", devices[shape]]  # fmt: skip
        builds.append((shape, subprocess.Popen(args)))
    for shape, process in builds:
        if process.wait() != 0:
            raise RuntimeError(f"building the {shape} model failed (exit {process.returncode})")
    return wanted


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.federation_real.models")
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import torch

    from bench.engine.model_setup import build_model_dir

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype, torch.float32)
    partial = args.out.with_name(args.out.name + ".partial")
    _, built_on = build_model_dir(
        partial, SHAPES[args.shape], args.tokenizer_dir, dtype, args.seed, args.device
    )
    partial.rename(args.out)  # whole or absent: a build cut short is not reused
    print(f"{args.shape}: built on {built_on} in {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
