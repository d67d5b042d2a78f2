"""`python -m bench.federation_real`: the routing arms on a real federation, then the same
scenario in fedsim, side by side (bench/federation_real/__init__.py).

    python -m bench.federation_real --preset gpu [--gpus N] [--arms ...] [--workload sharegpt|PATH]
        [--rate R] [--duration-s S] [--seed N] [--no-compare]   # real run (+ comparison)
    python -m bench.federation_real --compare DIR/NAME_real.json   # the comparison alone

The real run writes NAME_real.json (sites, card, workload spec and fingerprint, each arm's
figures) and NAME_requests.json.gz (every request's outcome); the comparison writes NAME.json and
NAME.md (real, simulated, errors, goals, ranking), by default into
bench/results/federation_real/.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx

from bench.common import results_dir, write_results
from bench.engine.paths import shared_path
from bench.federation_real.compare import compare, markdown
from bench.federation_real.federation import (
    ADMIN_TOKEN,
    GATEWAY,
    Federation,
    card_of,
    deltas,
    site_record,
)
from bench.federation_real.metrics import Served, summary
from bench.federation_real.models import ensure_models
from bench.federation_real.presets import Preset, choose, rate_for
from bench.federation_real.sim import simulate
from bench.federation_real.workload import WorkloadSpec, build, describe, fingerprint, marked
from bench.loadgen.client import run_open_loop
from bench.loadgen.workload import Request
from devtools.forkserver import FORK_SERVER_ENV
from fedllm_contract.tokenizer import load_tokenizer
from fedsim.step_models import STEP_MODELS

RESULTS = results_dir("federation_real")
WARM_UP = 16
_STARTED = time.monotonic()
_HITS = "fedllm_site_prefix_cache_hits_tokens_total"
_QUERIES = "fedllm_site_prefix_cache_queries_tokens_total"


def log(message: str) -> None:
    print(f"[{time.monotonic() - _STARTED:6.0f}s] {message}", flush=True)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.federation_real", description=__doc__)
    parser.add_argument("--preset", choices=("cpu", "gpu"), default="gpu")
    parser.add_argument("--gpus", type=int, default=None, help="sites (one a GPU); default all")
    parser.add_argument("--arms", nargs="*", default=None)
    parser.add_argument("--workload", default="sharegpt", help="sharegpt, or a trace's path")
    parser.add_argument("--rate", type=float, default=None, help="requests/s (preset's default)")
    parser.add_argument("--duration-s", type=float, default=None)
    parser.add_argument("--drain-s", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-dir", type=Path, default=None)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/fedllm-federation-real"))
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--name", default=None, help="default federation_real_<preset|card>")
    parser.add_argument("--step-models", type=Path, default=STEP_MODELS)
    parser.add_argument("--traces", type=Path, default=None, help="where --compare finds a trace")
    parser.add_argument("--no-compare", action="store_true", help="the real run alone")
    parser.add_argument("--compare", type=Path, default=None, help="a NAME_real.json to compare")
    return parser.parse_args(argv)


def _preset(args: argparse.Namespace) -> tuple[Preset, str]:
    """The preset with the command's overrides, and the card its sites run on."""
    preset = choose(args.preset, args.gpus)
    card = card_of(preset.sites)
    rate = args.rate or (preset.rate_rps if card == "cpu" else rate_for(preset, card))
    return replace(
        preset,
        arms=tuple(args.arms) if args.arms else preset.arms,
        rate_rps=rate,
        duration_s=args.duration_s or preset.duration_s,
        drain_s=args.drain_s if args.drain_s is not None else preset.drain_s,
    ), card


def gateway_offloads(port: int) -> float:
    text = httpx.get(
        f"http://127.0.0.1:{port}/metrics",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=10,
    ).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("fedllm_gateway_offloads_total{")
    )


def warm_up(federation: Federation, base: str, requests: Sequence[Request], vocab: int) -> None:
    """The workload's first WARM_UP requests, 0.1 s apart, with a marker of their own, before the
    first arm: first-call costs (kernels' first shapes, the sites' first streams) stay out of it."""
    warm = [replace(r, at_s=0.1 * i) for i, r in enumerate(requests[:WARM_UP])]
    log(f"warm-up: {len(warm)} requests")
    asyncio.run(run_open_loop(base, marked(warm, "warm-up", vocab), drain_s=60.0))
    if not federation.wait_idle(timeout_s=60):
        raise RuntimeError("the sites still had requests 60 s after the warm-up")


def run_arm(
    federation: Federation,
    arm: str,
    requests: Sequence[Request],
    preset: Preset,
    vocab: int,
    first: bool = False,
) -> tuple[dict[str, object], list[dict[str, object]]]:
    log(f"arm {arm}: gateway starting")
    gateway = federation.start_gateway(arm, replace(GATEWAY, policy=arm))
    try:
        if first:
            warm_up(federation, f"http://127.0.0.1:{gateway.port}", requests, vocab)
        before = federation.scrape_all()
        log(f"arm {arm}: {len(requests)} requests over {preset.duration_s:g}s")
        base = f"http://127.0.0.1:{gateway.port}"
        outcomes = asyncio.run(
            run_open_loop(base, marked(requests, arm, vocab), preset.drain_s)
        ).outcomes
        after = federation.scrape_all()
        offloads = gateway_offloads(gateway.port)
    finally:
        gateway.stop(timeout_s=30)
    if not federation.wait_idle(timeout_s=120):
        raise RuntimeError(f"arm {arm}: the sites still had requests 120 s after its gateway left")
    served = [Served.of_real(o) for o in outcomes]
    figures = summary(
        served,
        preset.slo,
        preset.duration_s,
        deltas(before, after, _QUERIES),
        deltas(before, after, _HITS),
    ) | {"offloads": offloads, "errors": sorted({o.error for o in outcomes if o.error})[:5]}
    log(
        f"arm {arm}: goodput {figures['goodput_rps']:.2f} req/s, TTFT p50/p99 "
        f"{figures['ttft_p50_s']:.3f}/{figures['ttft_p99_s']:.3f} s, TPOT p50 "
        f"{figures['tpot_p50_s']:.4f} s, finished {figures['by_site']}"
    )
    rows = [asdict(s) for s in served]
    return figures, rows


def real_run(args: argparse.Namespace, command: str) -> Path:
    preset, card = _preset(args)
    if preset.device == "cuda":
        # Sites start as processes of their own command line (CUDA in a fork is not safe).
        os.environ.pop(FORK_SERVER_ENV, None)
    tokenizer_dir = shared_path(args.tokenizer_dir, "tokenizers", "gpt2")
    vocab = len(load_tokenizer(tokenizer_dir))
    spec = WorkloadSpec(
        args.workload, preset.rate_rps, preset.duration_s, args.seed, vocab,
        preset.length_scale, preset.max_prompt_tokens, preset.max_answer_tokens,
        preset.block_tokens,
    )  # fmt: skip
    requests = build(spec)
    log(f"workload: {describe(requests)}")
    models = ensure_models(preset, args.work_dir, tokenizer_dir)
    log(f"models ready: {sorted(models)}")
    federation = Federation(preset, args.work_dir, models, tokenizer_dir)
    arms: dict[str, Any] = {}
    outcomes: dict[str, Any] = {}
    try:
        federation.start(timeout_s=900 if preset.device == "cuda" else 180)
        log(f"sites serving on {card}: {sorted(federation.sites)}")
        for i, arm in enumerate(preset.arms):
            arms[arm], outcomes[arm] = run_arm(federation, arm, requests, preset, vocab, i == 0)
        samples = federation.scrape_all()
    finally:
        federation.close()
    name = args.name or f"federation_real_{preset.name if card == 'cpu' else card}"
    payload = {
        "command": command,
        "preset": preset.name,
        "card": card,
        "sites": [site_record(s, samples[s.name]) for s in preset.sites],
        "gateway": asdict(GATEWAY) | {"policy": "per arm"},
        "slo": asdict(preset.slo),
        "drain_s": preset.drain_s,
        "workload_spec": spec.to_json(),
        "workload": describe(requests) | {"fingerprint": fingerprint(requests)},
        "arms": arms,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path: Path = args.out_dir / f"{name}_real.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    with gzip.open(args.out_dir / f"{name}_requests.json.gz", "wt") as handle:
        json.dump(outcomes, handle)
    log(f"wrote {path}")
    return path


def compare_run(path: Path, args: argparse.Namespace, command: str) -> Path:
    real = json.loads(path.read_text())
    log(f"simulating {sorted(real['arms'])} on {real['card']}")
    sim = simulate(real, args.step_models, args.traces or shared_path(None, "datasets", "traces"))
    result = compare(real["arms"], sim)
    name = path.name.removesuffix("_real.json")
    notes = [
        f"Real run: `{real['command']}` ({path.name}); {real['workload']['requests']} requests "
        f"over {real['workload_spec']['duration_s']:g} s, seed {real['workload_spec']['seed']}, "
        f"workload {real['workload_spec']['source']}, card {real['card']}.",
        "Sites: "
        + "; ".join(
            f"{s['name']} ({s['shape']}, {s['max_num_seqs']} slots, {s['one_way_ms']:g} ms one "
            f"way, {s['kv_blocks_total']} KV blocks)"
            for s in real["sites"]
        )
        + ".",
        f"SLO: TTFT <= {real['slo']['ttft_p99_s']} s and TPOT <= {real['slo']['tpot_p99_s']} s "
        "per request for goodput; the same at p99 for `p99 SLO met`.",
        "Step models: "
        + (
            str(args.step_models)
            if real["card"] != "cpu"
            else "each CPU site's own learned step cost (a check of the pipeline only)"
        )
        + ".",
    ]
    payload = {"real_run": real, "simulated": sim, **result, "step_models": str(args.step_models)}
    out = write_results(name, payload, markdown(real["arms"], sim, result, notes), command,
                        args.out_dir)  # fmt: skip
    log(f"wrote {out}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    args = parse(given)
    command = shlex.join(["python", "-m", "bench.federation_real", *given])
    if args.compare is not None:
        compare_run(args.compare, args, command)
        return 0
    path = real_run(args, command)
    if not args.no_compare:
        compare_run(path, args, command)
    return 0
