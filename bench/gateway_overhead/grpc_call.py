"""What one Generate call costs the gateway's gRPC client, by gRPC client I/O path.

    python -m bench.gateway_overhead.grpc_call [--rounds 4] [--calls 3000]
        [--experiments=-event_engine_client] [--experiments=event_engine_client]

The kit's fake site (cpu 0) answers each call with the real site's chunk sequence (accepted, one
chunk per token: 9 messages for the kit's completion). A client process on cpu 1 (the gateway's
core in the overhead benchmark) makes the calls one at a time with the gateway's stubs over
grpc.aio on uvloop, as the gateway does, and reports its own CPU time and latency per call.
Each `--experiments` value is a GRPC_EXPERIMENTS setting, which gRPC reads when it loads (hence
a process per setting); the settings alternate round by round. Writes
bench/results/gateway_overhead/grpc_client_call.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import command_line, markdown_table, results_dir, write_results
from bench.gateway_overhead.fedllm import SITE_PORT, Kit, start_site

ROOT = Path(__file__).resolve().parents[2]

_CLIENT = """
import asyncio, json, os, sys, time
import grpc, uvloop
from fedllm_contract.proto import site_pb2, site_pb2_grpc

async def main(calls):
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{sys.argv[2]}")
    stub = site_pb2_grpc.SiteEngineStub(channel)
    def request(i):
        r = site_pb2.GenerateRequest(request_id=f"c{i}-{time.time_ns()}",
                                     prompt_token_ids=[15496, 11, 995], predicted_tokens=8)
        r.sampling.max_tokens = 16
        return r
    for i in range(200):
        async for _ in stub.Generate(request(i)):
            pass
    cpu, latencies, messages = time.process_time(), [], 0
    for i in range(calls):
        started = time.perf_counter()
        messages = 0
        async for _ in stub.Generate(request(i)):
            messages += 1
        latencies.append((time.perf_counter() - started) * 1000)
    cpu = time.process_time() - cpu
    await channel.close()
    latencies.sort()
    print(json.dumps({"cpu_ms_per_call": cpu * 1000 / calls, "p50_ms": latencies[calls // 2],
                      "messages_per_call": messages}))

uvloop.run(main(int(sys.argv[1])))
"""


def _call(experiments: str, calls: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GRPC_EXPERIMENTS": experiments}
    command = ["taskset", "-c", "1", sys.executable, "-c", _CLIENT, str(calls), str(SITE_PORT)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_overhead.grpc_call")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--experiments", action="append", help="GRPC_EXPERIMENTS values")
    parser.add_argument("--gwbench", type=Path, default=ROOT.parent / "shared" / "gwbench")
    parser.add_argument("--tokenizer", type=Path, default=ROOT.parent / "shared/tokenizers/gpt2")
    parser.add_argument("--name", default="grpc_client_call")
    args = parser.parse_args(argv)
    settings = args.experiments or ["event_engine_client", "-event_engine_client"]
    kit = Kit(args.gwbench.resolve(), args.tokenizer.resolve(), None)
    site = start_site(ROOT, kit)
    runs: dict[str, list[dict[str, Any]]] = {setting: [] for setting in settings}
    try:
        for round_index in range(args.rounds):
            for setting in settings if round_index % 2 == 0 else settings[::-1]:
                runs[setting].append(_call(setting, args.calls))
    finally:
        site.terminate()
        site.wait(30)
    rows = [
        {
            "GRPC_EXPERIMENTS": setting,
            "cpu_ms_per_call": statistics.median(r["cpu_ms_per_call"] for r in own),
            "p50_ms": statistics.median(r["p50_ms"] for r in own),
            "messages_per_call": own[-1]["messages_per_call"],
        }
        for setting, own in runs.items()
    ]
    columns = list(rows[0])
    table = markdown_table(columns, [[row[c] for c in columns] for row in rows])
    text = (
        f"One Generate call at a time against the kit's fake site, client on cpu 1, "
        f"{args.rounds} rounds x {args.calls} calls per setting; medians over rounds.\n\n"
        f"{table}\n"
    )
    command = command_line("bench.gateway_overhead.grpc_call", argv)
    write_results(
        args.name, {"rows": rows, "runs": runs}, text, command, results_dir("gateway_overhead")
    )
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
