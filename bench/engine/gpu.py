"""GPU engine benchmark: this engine against transformers on one trace, and decode steps
against the HBM roofline, in one run.

    python -m bench.engine.gpu          (writes bench/results/engine/engine_h200.{json,md})
    python -m bench.engine.gpu --small --device cpu --dtype float32    (smoke test)

A Llama-3.2-1B-shaped model with random weights (bf16) is built with transformers, saved, and
loaded back through site_engine.model_loading.load_model, as a user's model directory would be.
The trace replays real prompts (GPT-2 token ids of Alpaca random rows and LIMA) with their
reference response lengths (greedy, ignore_eos). Phases, each with progress lines on stdout:

1. copy bandwidth: a large device-to-device copy, the measured HBM rate;
2. decode sweep: the median time of a whole `engine.step()` with b sequences decoding at a
   prompt length of 512, against roofline = (weight bytes + KV bytes read) / copy rate;
3. this engine, all requests at once ("burst"), on the whole trace;
4. this engine, burst, on the subset the transformers baselines run (same requests);
5. this engine, Poisson arrivals at --poisson-rate requests/s, on the whole trace;
6. transformers `generate` with static batches on the subset;
7. transformers continuous batching (generate_batch's manager) on the subset.

Results are rewritten after every phase (with "complete": false until the end), so a run cut
short by a time limit still leaves what it measured; --deadline-s shrinks the budgets of later
phases so that the whole run ends in time.

This module owns the command line (flags, the defaults of the full run and of --small, where the
shared tokenizer and corpora are found) and main(), which runs the phases of
bench.engine.run_phases in order; the measurements themselves are in bench.engine.roofline,
decode_sweep, engine_runs, hf_baselines and hf_continuous, the results files in report.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import results_dir
from bench.engine.harness import Deadline, Progress, exit_if_threads_linger
from bench.engine.model_setup import LLAMA_1B_SHAPE, SMALL_SHAPE
from bench.engine.paths import resolve_data_dir, shared_path
from bench.engine.report import report, save, versions
from bench.engine.run_phases import (
    RunContext,
    decode_phase,
    engine_phases,
    hf_phases,
    model_phase,
    trace_phase,
)

# Defaults of the full run, and of --small (a smoke test on CPU); flags given explicitly win.
FULL_DEFAULTS: dict[str, Any] = {
    "requests_alpaca": 800,
    "requests_lima": 200,
    "max_num_seqs": 256,
    "hf_requests": 256,
    "decode_batch_sizes": [1, 32, 64, 128, 256],
    "decode_steps": 64,
    "decode_warmup_steps": 8,
    "decode_prompt_len": 512,
    "copy_mib": 4096,
    "max_prompt_tokens": 1024,
    "max_response_tokens": 1024,
    "poisson_rate": 20.0,
    "engine_warmup_requests": 8,
    "name": "engine_h200",
}
SMALL_DEFAULTS: dict[str, Any] = {
    "requests_alpaca": 6,
    "requests_lima": 2,
    "max_num_seqs": 4,
    "hf_requests": 3,
    "decode_batch_sizes": [1, 2],
    "decode_steps": 3,
    "decode_warmup_steps": 1,
    "decode_prompt_len": 16,
    "copy_mib": 16,
    "max_prompt_tokens": 48,
    "max_response_tokens": 12,
    "poisson_rate": 50.0,
    "engine_warmup_requests": 2,
    "name": "engine_small",
}

# --- arguments ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine.gpu", description=(__doc__ or "").split("\n\n")[0]
    )
    add = parser.add_argument
    add("--requests-alpaca", type=int, help="Alpaca random rows in the trace (800)")
    add("--requests-lima", type=int, help="LIMA records in the trace (200)")
    add("--max-num-seqs", type=int, help="engine batch limit, also the static batch size (256)")
    add("--max-num-batched-tokens", type=int, default=4096, help="engine tokens per step")
    add("--block-size", type=int, default=16)
    add("--kv-cache-gib", type=float, default=0.0, help="KV budget; 0 lets the engine size it")
    add("--poisson-rate", type=float, help="requests/s of the Poisson run (20)")
    add("--hf-requests", type=int, help="requests of the burst trace the baselines run (256)")
    add("--skip-hf", action="store_true", help="skip both transformers baselines")
    add("--skip-poisson", action="store_true")
    add("--engine-warmup-requests", type=int, help="short requests before each engine run (8)")
    add(
        "--hf-batch-api",
        choices=("manager", "generate_batch"),
        default="manager",
        help="continuous batching through the manager (per-request max_new_tokens) or one "
        "generate_batch call (one max_new_tokens for all)",
    )
    add("--decode-batch-sizes", type=int, nargs="+", help="decode sweep batch sizes")
    add("--decode-steps", type=int, help="timed decode steps per batch size (64)")
    add("--decode-warmup-steps", type=int, help="untimed decode steps before those (8)")
    add("--decode-prompt-len", type=int, help="prompt length of the decode sweep (512)")
    add("--copy-mib", type=int, help="size of the bandwidth copy in MiB (4096)")
    add("--max-prompt-tokens", type=int, help="prompt cap in tokens (1024)")
    add("--max-response-tokens", type=int, help="response cap in tokens (1024)")
    add("--tokenizer-dir", type=Path, default=None, help="GPT-2 tokenizer (../shared/...)")
    add("--data-dir", type=Path, default=None, help="corpora (../shared/datasets)")
    add("--seed", type=int, default=0)
    add("--name", default=None, help="result file name (engine_h200)")
    add("--results-dir", type=Path, default=results_dir("engine"), help="where results go")
    add("--small", action="store_true", help="tiny model and trace: a smoke test")
    add("--device", default="cuda")
    add("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    add("--time-budget-s", type=float, default=120.0, help="cap of each transformers baseline")
    add("--engine-time-budget-s", type=float, default=150.0, help="cap of each engine run")
    add("--deadline-s", type=float, default=480.0, help="the whole run; later phases shrink")
    args = parser.parse_args(argv)
    defaults = SMALL_DEFAULTS if args.small else FULL_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# --- orchestration -----------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command = "python -m bench.engine.gpu" + "".join(f" {shlex.quote(a)}" for a in argv)
    log = Progress()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available: run on the GPU machine or pass --device cpu")
    deadline = Deadline(log, args.deadline_s)
    tokenizer_dir = shared_path(args.tokenizer_dir, "tokenizers", "gpt2")
    data_dir = resolve_data_dir(args.data_dir)
    shape = SMALL_SHAPE if args.small else LLAMA_1B_SHAPE
    phases: dict[str, float] = {}
    errors: dict[str, str] = {}
    payload: dict[str, Any] = {
        "complete": False,
        "engine_tok_s": None,
        "hf_generate_tok_s": None,
        "hf_generate_batch_tok_s": None,
        "decode_step_ms": {},
        "roofline_step_ms": {},
        "config": {
            key: (str(value) if isinstance(value, Path) else value)
            for key, value in vars(args).items()
        }
        | {"tokenizer_dir": str(tokenizer_dir), "data_dir": str(data_dir)},
        "phases_s": phases,
        "errors": errors,
        "versions": versions(),
    }
    run = RunContext(args, command, log, device, deadline, payload, phases, errors)
    log(f"bench.engine.gpu on {device} ({args.dtype}); results name {args.name}")
    if device.type == "cuda":
        log(f"  {torch.cuda.get_device_name(device)}, torch {torch.__version__}")

    workload, subset, arrivals = trace_phase(run, tokenizer_dir, data_dir)
    loaded = model_phase(run, shape, tokenizer_dir)
    decode_phase(run, loaded)
    run_hf = not args.skip_hf and len(subset) > 0
    engine_phases(run, loaded, workload, subset, arrivals, run_hf)
    hf: dict[str, Any] = {}
    payload["hf"] = hf
    if run_hf:
        hf_phases(run, loaded, subset, hf)

    payload["complete"] = True
    path = save(args, payload, command)
    print(report(payload), flush=True)
    print(f"wrote {path} (total {log.elapsed():.1f}s)", flush=True)
    return payload


if __name__ == "__main__":
    main()
    # A continuous-batching thread that ignored its stop must not keep the process alive.
    exit_if_threads_linger()
