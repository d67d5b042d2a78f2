"""The same benchmark phases with another engine package: the before of a before/after.

The baseline is another commit's `site_engine/engine` folder (on the GPU machine, the checkout
the device was given, while this tree is the change under test). A copy of this checkout's
benchmark and site code is made with that engine package in place of this one, and
`python -m bench.engine.serving --phases <--baseline-phases>` runs there in a subprocess on the same
model directory: the same measurement code, only the engine differs. Its results come back as
the "baseline" section of this run's payload.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.engine.paths import REPO_ROOT

# The packages the benchmark imports; site_engine/engine is then replaced by the baseline's.
_PACKAGES = ("bench", "site_engine", "predictor", "fedllm_contract", "fedsim")


def hybrid_tree(baseline_engine: Path, into: Path) -> Path:
    """A copy of this checkout's packages with `baseline_engine` as site_engine/engine."""
    if not (baseline_engine / "paged_engine.py").is_file():
        raise FileNotFoundError(f"{baseline_engine} is not a site_engine/engine package")
    ignore = shutil.ignore_patterns("__pycache__", "results", "*.pyc")
    for package in _PACKAGES:
        shutil.copytree(REPO_ROOT / package, into / package, ignore=ignore)
    shutil.rmtree(into / "site_engine" / "engine")
    shutil.copytree(baseline_engine, into / "site_engine" / "engine", ignore=ignore)
    return into


def run_baseline(
    args: argparse.Namespace,
    tokenizer_dir: Path,
    data_dir: Path,
    log: Any,
    traces_dir: Path | None = None,
) -> dict[str, Any]:
    """Runs the phases --baseline-phases with the baseline engine, on the same model, mixes,
    rates and limits; never raises."""
    with tempfile.TemporaryDirectory(prefix="fedllm-baseline-") as tmp:
        root = Path(tmp)
        command = [
            sys.executable, "-m", "bench.engine.serving", "--phases", args.baseline_phases,
            "--model-dir", str(args.model_dir.resolve()),
            "--tokenizer-dir", str(tokenizer_dir.resolve()),
            "--data-dir", str(data_dir.resolve()),
            "--results-dir", str(root / "results"), "--name", "baseline",
            "--device", args.device, "--dtype", args.dtype, "--seed", str(args.seed),
            "--step-reps", str(args.step_reps), "--mixes", *args.mixes,
            "--rates", *map(str, args.rates), "--duration-s", str(args.duration_s),
            "--drain-s", str(args.drain_s), "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--deadline-s", str(args.baseline_timeout_s - 30), "--reserve-s", "0",
            "--context-cap", str(args.context_cap), "--slo-ttft-ms", str(args.slo_ttft_ms),
            "--slo-tpot-ms", str(args.slo_tpot_ms),
        ] + (["--small"] if args.small else []) + (
            ["--long-context"] if args.long_context else []) + (
            ["--traces-dir", str(traces_dir)] if traces_dir is not None else [])  # fmt: skip
        result: dict[str, Any] = {
            "engine_dir": str(args.baseline_engine),
            "command": " ".join(command[1:]),
        }
        try:
            tree = hybrid_tree(args.baseline_engine.resolve(), root / "tree")
            log(f"baseline engine from {args.baseline_engine}: {args.baseline_phases} in a "
                "subprocess")  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
            done = subprocess.run(command, cwd=tree, env=env, timeout=args.baseline_timeout_s,
                                  check=False)  # fmt: skip
            result["returncode"] = done.returncode
            payload = json.loads((root / "results" / "baseline.json").read_text())
            for key in ("step_shapes", "mixed_vs_parts", "burst", "errors", "sweeps",
                        "goodput_rate_rps", "goodput_output_tok_s", "mixes"):  # fmt: skip
                result[key] = payload.get(key)
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
            log(f"baseline failed: {result['error']}")
        return result
