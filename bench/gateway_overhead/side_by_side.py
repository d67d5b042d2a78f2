"""Two or more gateways under the same load, measured side by side: a change's effect on a lone
request's latency (or, with --concurrency, on throughput), told apart from the host's drift.

    python -m bench.gateway_overhead.side_by_side --variant base=DIR --variant new=DIR[:K=V,...]
        [--rounds 10] [--requests 600] [--concurrency 1] [--stream] [--database URL]
        [--predictor DIR] [--name gateway_side_by_side]

The overhead benchmark runs one gateway after another; on this shared 2-vCPU machine the vCPU
speed moves up to ~1.7x within minutes, more than most changes move a lone request's latency.
Here every variant (a checkout, plus environment settings) is started at once, each on the same
core (cpu 1) next to one fake gRPC site (cpu 0, the kit's `fake_site.py`); only one is under
load at a time, and the load generator (the kit's `load.py`, cpu 0) alternates between them
round after round (the order reversed every other round). A variant's figures are medians over
rounds; the paired difference compares each round's run with the first variant's run of the
same round. Idle variants keep their background work (health checks, load reports), which is
small and the same for all.

`--variant NAME=CHECKOUT[:KEY=VALUE,...]`: KEY=VALUE are environment variables of that
gateway (e.g. GATEWAY_REQUEST_LOG_FLUSH_MS=100); DB=<url> gives it its own database.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import command_line, markdown_table, results_dir, write_results
from bench.gateway_overhead.fedllm import GW_PORT, Kit, gateway_command, start_site
from bench.gateway_overhead.profile import load_command, wait_ready

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Variant:
    name: str
    checkout: Path
    env: dict[str, str]
    port: int


def parse_variant(spec: str, port: int) -> Variant:
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"--variant takes NAME=CHECKOUT[:KEY=VALUE,...], got {spec!r}")
    checkout, _, assignments = rest.partition(":")
    env: dict[str, str] = {}
    for assignment in filter(None, assignments.split(",")):
        key, sep, value = assignment.partition("=")
        if not sep or not key:
            raise ValueError(f"{spec!r}: {assignment!r} is not KEY=VALUE")
        env[key] = value
    return Variant(name, Path(checkout).resolve(), env, port)


def _load(
    kit: Kit, port: int, concurrency: int, requests: int, stream: bool, pid: int | None
) -> dict[str, Any]:
    command = load_command(kit, concurrency, requests, stream, port, pid)
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def _start(variant: Variant, kit: Kit, database: str | None, work: Path) -> subprocess.Popen[bytes]:
    (work / "var").mkdir(parents=True)
    env = dict(variant.env)
    database = env.pop("DB", database)
    command = gateway_command(variant.checkout, work, kit, database, variant.port, env)
    log = (work / "gateway.log").open("w")
    return subprocess.Popen(["taskset", "-c", "1", "bash", "-c", command], stdout=log, stderr=log)


def measure(args: argparse.Namespace, variants: list[Variant], kit: Kit) -> dict[str, Any]:
    work = Path(f"/tmp/gwbench/side-by-side-{int(time.time())}")
    site = start_site(ROOT, kit)
    gateways: dict[str, subprocess.Popen[bytes]] = {}
    key = "ttft_ms" if args.stream else "latency_ms"
    runs: dict[str, list[dict[str, float]]] = {v.name: [] for v in variants}
    try:
        for variant in variants:
            gateways[variant.name] = _start(variant, kit, args.database, work / variant.name)
            wait_ready(f"http://127.0.0.1:{variant.port}/readyz", gateways[variant.name])
            _load(kit, variant.port, 8, 300, args.stream, None)  # warm-up
        for round_index in range(args.rounds):
            order = variants if round_index % 2 == 0 else variants[::-1]
            for variant in order:
                pid = gateways[variant.name].pid
                result = _load(kit, variant.port, args.concurrency, args.requests, args.stream, pid)
                runs[variant.name].append(
                    {
                        "rps": result["rps"],
                        "p50_ms": result[key]["p50"],
                        "p90_ms": result[key]["p90"],
                        "cpu_ms_per_request": result.get("sut_cpu_ms_per_req") or 0.0,
                        "failed": result["failed"],
                    }
                )
    finally:
        for process in [*gateways.values(), site]:
            process.terminate()
        for process in [*gateways.values(), site]:
            process.wait(30)
    return {"metric": key, "runs": runs}


def summarize(
    variants: list[Variant], runs: dict[str, list[dict[str, float]]]
) -> list[dict[str, Any]]:
    first = runs[variants[0].name]
    rows = []
    for variant in variants:
        own = runs[variant.name]
        diffs = [a["p50_ms"] - b["p50_ms"] for a, b in zip(own, first, strict=True)]
        rows.append(
            {
                "variant": variant.name,
                "checkout": str(variant.checkout),
                "env": variant.env,
                "rps": statistics.median(r["rps"] for r in own),
                "p50_ms": statistics.median(r["p50_ms"] for r in own),
                "p90_ms": statistics.median(r["p90_ms"] for r in own),
                "cpu_ms_per_request": statistics.median(r["cpu_ms_per_request"] for r in own),
                "paired_p50_diff_ms": statistics.median(diffs),
                "rounds_lower": sum(d < 0 for d in diffs),
                "failed": sum(int(r["failed"]) for r in own),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_overhead.side_by_side")
    parser.add_argument("--variant", action="append", required=True, help="NAME=CHECKOUT[:K=V]")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=600, help="per variant and round")
    parser.add_argument("--concurrency", type=int, default=1, help="the load's concurrency")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--database", help="GATEWAY_DATABASE_URL (default: SQLite)")
    parser.add_argument("--predictor", type=Path, default=ROOT / "var" / "predictor" / "default")
    parser.add_argument("--gwbench", type=Path, default=ROOT.parent / "shared" / "gwbench")
    parser.add_argument("--tokenizer", type=Path, default=ROOT.parent / "shared/tokenizers/gpt2")
    parser.add_argument("--name", default="gateway_side_by_side", help="result file name")
    args = parser.parse_args(argv)
    variants = [parse_variant(spec, GW_PORT + 1 + i) for i, spec in enumerate(args.variant)]
    kit = Kit(args.gwbench.resolve(), args.tokenizer.resolve(), args.predictor.resolve())
    measured = measure(args, variants, kit)
    rows = summarize(variants, measured["runs"])
    first = variants[0].name
    table = markdown_table(
        ["variant", "req/s", "p50 ms", "p90 ms", "CPU ms/req", f"paired p50 diff vs {first}",
         "rounds lower", "failed"],
        [
            [r["variant"], r["rps"], r["p50_ms"], r["p90_ms"], r["cpu_ms_per_request"],
             r["paired_p50_diff_ms"], f"{r['rounds_lower']}/{args.rounds}", r["failed"]]
            for r in rows
        ],
    )  # fmt: skip
    what = "TTFT" if args.stream else "latency"
    text = (
        f"Concurrency {args.concurrency}, {'stream' if args.stream else 'non-stream'} ({what}), "
        f"{args.rounds} rounds x {args.requests} requests per variant, "
        f"database {args.database or 'SQLite'}; medians over rounds.\n\n{table}\n"
    )
    command = command_line("bench.gateway_overhead.side_by_side", argv)
    write_results(
        args.name, {"variants": rows, **measured}, text, command, results_dir("gateway_overhead")
    )
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
