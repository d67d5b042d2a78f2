"""Where a site's start goes, cold and from the warm pool, on the CPU preset's model:

    python -m bench.elastic.start_breakdown [--tokenizer ../shared/tokenizers/gpt2] [--runs 3]

Each run starts a site cold (`python -m site_engine`, as the local actuator's cold start does)
and claims a pooled one (`python -m site_engine --pool`, prepared beforehand, claimed on stdin as
gateway/scaling/local_pool.py does), alternating which goes first. For each: the phases its
start-up log's `start phases:` line gives (site_engine/start_phases.py), then from outside the
seconds from the launch (cold) or the claim (pooled) to its READY line and to the first token of
a request sent then. Writes bench/results/elastic/start_breakdown_cpu.{json,md} (`--name`;
`--device cuda` for a GPU: then a KV size given, as here, still runs the memory trial): keys
`cold_first_token_s` and `pooled_first_token_s` (one entry a run), the phases' min-max.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from bench.common import markdown_table, results_dir, write_results
from fedllm_contract.proto import site_pb2, site_pb2_grpc
from site_engine.make_model import make_model_dir

ROOT = Path(__file__).resolve().parents[2]
_READY = re.compile(rb"READY port=(\d+)")
_PHASES = re.compile(rb"start phases: (.*) \(total")
_POLL_S = 0.01


# Set by --device: the sites' device flags ("--device cuda --dtype bfloat16" on a GPU).
DEVICE_ARGS: list[str] = []


def site_command(model_dir: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "site_engine", "--model", str(model_dir), "--site-name", name,
            "--host", "127.0.0.1", "--port", "0", "--max-num-seqs", "4", "--torch-threads", "1",
            "--kv-cache-mib", "16", *DEVICE_ARGS]  # fmt: skip


def wait_for(log_path: Path, pattern: re.Pattern[bytes], popen: subprocess.Popen[bytes],
             timeout_s: float = 600.0) -> re.Match[bytes]:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = pattern.search(log_path.read_bytes())
        if match:
            return match
        if popen.poll() is not None:
            raise RuntimeError(f"site exited ({popen.returncode}): see {log_path}")
        time.sleep(_POLL_S)
    raise TimeoutError(f"no {pattern.pattern!r} in {log_path} after {timeout_s:g}s")


def first_token(port: int, request_id: str) -> None:
    """Sends one request and returns once its first token has come."""
    request = site_pb2.GenerateRequest(
        request_id=request_id, prompt="Hello there", sampling=site_pb2.SamplingParams(max_tokens=4)
    )
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        for chunk in site_pb2_grpc.SiteEngineStub(channel).Generate(request, timeout=120):
            if chunk.token_ids or chunk.text:
                return
    raise RuntimeError("the stream ended without a token")


def phases_of(log_path: Path) -> dict[str, float]:
    match = _PHASES.search(log_path.read_bytes())
    if match is None:
        return {}
    parts = (part.rsplit(" ", 1) for part in match.group(1).decode().split(", "))
    return {name: float(seconds.rstrip("s")) for name, seconds in parts}


def launch(command: list[str], log_path: Path, pooled: bool) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if pooled else subprocess.DEVNULL,
            cwd=ROOT,
        )


def serve_and_answer(popen: subprocess.Popen[bytes], log_path: Path, began: float,
                     name: str) -> dict[str, Any]:  # fmt: skip
    """From `began` (the launch or the claim): READY, then a first token; the phases logged."""
    port = int(wait_for(log_path, _READY, popen).group(1))
    ready = time.monotonic()
    first_token(port, f"{name}-1")
    answered = time.monotonic()
    return {"ready_s": ready - began, "first_token_s": answered - began,
            "phases": phases_of(log_path)}  # fmt: skip


def stop(popen: subprocess.Popen[bytes]) -> None:
    if popen.poll() is None:
        popen.terminate()
        try:
            popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


def cold(model_dir: Path, work: Path, name: str) -> dict[str, Any]:
    log_path = work / f"{name}.log"
    began = time.monotonic()
    popen = launch(site_command(model_dir, name), log_path, pooled=False)
    try:
        return serve_and_answer(popen, log_path, began, name)
    finally:
        stop(popen)


def pooled(model_dir: Path, work: Path, name: str) -> dict[str, Any]:
    """A pooled process prepared (waited for: that is the pool's time, not the start's), then
    claimed with its site's name, as the local actuator claims one."""
    log_path = work / f"{name}.log"
    command = [*site_command(model_dir, f"{name}-pool"), "--pool",
               "--kv-plan-file", str(work / "kv-plans.json")]  # fmt: skip
    popen = launch(command, log_path, pooled=True)
    try:
        wait_for(log_path, re.compile(rb"POOLED pid="), popen)
        assert popen.stdin is not None
        began = time.monotonic()
        popen.stdin.write(json.dumps({"args": ["--site-name", name], "env": {}}).encode() + b"\n")
        popen.stdin.flush()
        return serve_and_answer(popen, log_path, began, name)
    finally:
        stop(popen)


def measure(tokenizer: Path, runs: int) -> dict[str, list[dict[str, Any]]]:
    work = Path(tempfile.mkdtemp(prefix="start-breakdown-"))
    model_dir = make_model_dir(work / "tiny-llama", "llama", tokenizer)
    results: dict[str, list[dict[str, Any]]] = {"cold": [], "pooled": []}
    # A pooled start of a new key records its KV plan; the runs measure the starts that read it.
    pooled(model_dir, work, "warmup")
    for index in range(runs):
        order = ("cold", "pooled") if index % 2 == 0 else ("pooled", "cold")
        for kind in order:
            start = cold if kind == "cold" else pooled
            results[kind].append(start(model_dir, work, f"{kind}-{index}"))
    return results


def _span(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def report(results: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, Any], str]:
    phases = [p for run in results["cold"] + results["pooled"] for p in run["phases"]]
    order = list(dict.fromkeys(phases))
    rows = []
    for phase in [*order, "ready_s", "first_token_s"]:
        row: list[object] = [phase]
        for kind in ("cold", "pooled"):
            runs = results[kind]
            values = [r[phase] if phase in r else r["phases"].get(phase) for r in runs]
            known = [v for v in values if v is not None]
            row.append(_span(known) if known else "-")
        rows.append(row)
    table = markdown_table(["phase", "cold s (min-max)", "pooled s (min-max)"], rows)
    cold_ft = [round(r["first_token_s"], 3) for r in results["cold"]]
    pooled_ft = [round(r["first_token_s"], 3) for r in results["pooled"]]
    payload = {
        "cold_first_token_s": cold_ft,
        "pooled_first_token_s": pooled_ft,
        "pooled_within_1s": all(v <= 1.0 for v in pooled_ft),
        "cold_median_s": statistics.median(cold_ft),
        "pooled_median_s": statistics.median(pooled_ft),
        "runs": results,
    }
    return payload, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.elastic.start_breakdown")
    parser.add_argument("--tokenizer", type=Path, default=ROOT.parent / "shared/tokenizers/gpt2")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (bfloat16; the trial runs)")
    parser.add_argument("--name", default="start_breakdown_cpu", help="result file name")
    args = parser.parse_args(argv)
    if args.device != "cpu":
        DEVICE_ARGS[:] = ["--device", args.device, "--dtype", "bfloat16"]
    payload, table = report(measure(args.tokenizer.resolve(), args.runs))
    note = (
        "Phases from each site's `start phases:` log line; `ready_s` and `first_token_s` from "
        "outside: from the launch (cold) or the claim (pooled) to its READY line and to the "
        "first token of a request sent then. A pooled process's `imports` and `pool_prepare` "
        "(weights on the host, tokenizer, grammar compiler) ran before its claim, and "
        "`pooled_wait` is how long it then waited: neither is part of its start. CPU preset: "
        "a tiny random Llama with the GPT-2 tokenizer, one torch thread."
    )
    given = sys.argv[1:] if argv is None else argv
    command = "python -m bench.elastic.start_breakdown " + " ".join(given)
    write_results(args.name, payload, f"{table}\n\n{note}\n", command,
                  results_dir("elastic"))  # fmt: skip
    print(table)
    print("cold first token s:", payload["cold_first_token_s"])
    print("pooled first token s:", payload["pooled_first_token_s"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
