"""`python -m bench.serving_path`: the command line of both modes (bench/serving_path/__init__.py
says what each measures)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path

from bench.common import results_dir, write_results
from bench.engine.harness import Progress
from bench.engine.paths import shared_path

RESULTS = results_dir("serving_path")
# --quick: a few seconds of everything, for a smoke test of the wiring (no figure to quote).
QUICK_CPU = {"streams": 32, "clients": 2, "max_tokens": 32, "ramp_s": 1.0, "warmup_s": 4.0,
             "seconds": 3.0, "reps": 2, "drain_s": 30.0}  # fmt: skip


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serving_path", description=__doc__)
    add = parser.add_argument
    add("--mode", choices=("cpu", "gpu"), default="cpu")
    add("--name", help="results file name (serving_path_cpu, serving_path_gpu_<preset>)")
    add("--out-dir", type=Path, default=RESULTS)
    add("--work-dir", type=Path, default=Path("/tmp/fedllm-serving-path"))
    add("--tokenizer-dir", type=Path, default=None, help="default ../shared/tokenizers/gpt2")
    add("--clients", type=int, help="client processes (cpu mode 4, gpu mode 8)")
    add("--drain-s", type=float, help="how long open answers may finish (cpu 120, gpu 20)")
    add("--report-only", type=Path, default=None, metavar="NAME.json",
        help="write NAME.md again from NAME.json (its command and machine kept)")  # fmt: skip
    add("--gateway-env", action="append", default=[], metavar="KEY=VALUE",
        help="a GATEWAY_* setting for the gateway (repeatable)")  # fmt: skip
    cpu = parser.add_argument_group("cpu mode (defaults: bench/serving_path/cpu_mode.CpuSetup)")
    cpu.add_argument("--streams", type=int, help="concurrent streams (1024)")
    cpu.add_argument("--max-tokens", type=int, help="each answer's tokens (256)")
    cpu.add_argument("--rows", type=int, help="the synthetic engine's rows a step (1024)")
    cpu.add_argument("--step-ms", type=float, help="its step period (10)")
    cpu.add_argument("--seconds", type=float, help="one measurement window (30)")
    cpu.add_argument("--reps", type=int, help="windows measured (3)")
    cpu.add_argument("--warmup-s", type=float, help="before the first window (45)")
    cpu.add_argument("--ramp-s", type=float, help="the streams' starts spread over (10)")
    cpu.add_argument("--quick", action="store_true", help="a few seconds, few streams: smoke")
    gpu = parser.add_argument_group("gpu mode (defaults: bench/serving_path/gpu_mode.setup_of)")
    gpu.add_argument("--preset", choices=("gpu", "cpu"), default="gpu",
                     help="cpu: a tiny model on this machine's CPU, the wiring only")  # fmt: skip
    gpu.add_argument("--rates", type=float, nargs="+", help="requests/s (160 256)")
    gpu.add_argument("--duration-s", type=float, help="seconds of arrivals a rate (20)")
    gpu.add_argument("--one-way-ms", type=float, help="gateway to site delay (5)")
    gpu.add_argument("--seed", type=int, default=0)
    gpu.add_argument("--skip-engine", action="store_true", help="the path alone")
    return parser.parse_args(argv)


def gateway_env(pairs: Sequence[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.startswith("GATEWAY_"):
            raise SystemExit(f"--gateway-env wants GATEWAY_NAME=VALUE, got {pair!r}")
        env[key] = value
    return env


def cpu_main(args: argparse.Namespace, command: str) -> Path:
    from bench.serving_path.cpu_mode import CpuSetup, run_cpu
    from bench.serving_path.report import cpu_markdown
    from site_engine.make_model import make_model_dir

    # What the command gave, over --quick's values, over CpuSetup's defaults.
    given = {
        f.name: getattr(args, f.name, None) for f in fields(CpuSetup) if f.name != "gateway_env"
    }
    chosen = (QUICK_CPU if args.quick else {}) | {k: v for k, v in given.items() if v is not None}
    setup = CpuSetup(**chosen)
    setup = replace(setup, gateway_env=setup.gateway_env | args.gateway_env)
    tokenizer = shared_path(args.tokenizer_dir, "tokenizers", "gpt2")
    model_dir = args.work_dir / "tiny"
    if not (model_dir / "config.json").is_file():
        make_model_dir(model_dir, "llama", tokenizer)
    log = Progress()
    log(f"cpu mode: {setup}")
    payload = run_cpu(setup, args.work_dir, model_dir, log)
    name = args.name or "serving_path_cpu"
    path = write_results(name, payload, cpu_markdown(payload), command, args.out_dir)
    log(f"wrote {path}")
    return path


def rewrite_report(path: Path) -> Path:
    """The Markdown of a results file again, from its JSON (a report changed, not the run)."""
    from bench.serving_path.report import cpu_markdown, gpu_markdown

    payload = json.loads(path.read_text())
    markdown = cpu_markdown(payload) if payload["mode"] == "cpu" else gpu_markdown(payload)
    out = path.with_suffix(".md")
    out.write_text(
        f"# {path.stem}\n\nCommand: `{payload['command']}`\n\nMachine: {payload['machine']}"
        f"\n\n{markdown}\n"
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    args = parse(given)
    args.gateway_env = gateway_env(args.gateway_env)
    command = shlex.join(["python", "-m", "bench.serving_path", *given])
    if args.report_only is not None:
        rewrite_report(args.report_only)
        return 0
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.mode == "cpu":
        cpu_main(args, command)
    else:
        from bench.serving_path.gpu_mode import gpu_main

        gpu_main(args, command, Progress())
    return 0
