"""The embedded default, end to end: three site engines in three "clouds" and a gateway on this
machine with SQLite, a few dozen dataset prompts through the public HTTP API, and a table of what
each site served.

    python -m gateway.demo [--requests 36] [--keep-running] [--data-dir ../shared/datasets]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway.db.session import create_engine, create_sessionmaker
from gateway.launch import ManagedProcess, spawn_site, start_gateway, wait_until_serving
from gateway.services.stats import SiteTotals, site_totals
from predictor.build_default import build_default
from predictor.datasets import load_corpus
from site_engine.make_model import make_model_dir
from site_engine.tokenizer import load_tokenizer

MODEL_NAME = "tiny-llama"
DEMO_SITES = (
    ("aws-us-east-1", "aws", "us-east-1"),
    ("gcp-europe-west4", "gcp", "europe-west4"),
    ("azure-japaneast", "azure", "japaneast"),
)


@dataclass(frozen=True, slots=True)
class DemoResult:
    ok: bool
    site: str
    stream: bool
    latency_s: float
    detail: str = ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gateway.demo", description=__doc__)
    parser.add_argument("--data-dir", type=Path, default=None, help="default: ../shared/datasets")
    parser.add_argument("--tokenizer-dir", type=Path, default=Path("../shared/tokenizers/gpt2"))
    parser.add_argument("--work-dir", type=Path, default=Path("var/demo"))
    parser.add_argument("--requests", type=int, default=36)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=48, help="cap on replayed lengths")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--keep-running", action="store_true", help="leave services up")
    parser.add_argument("--no-predictor", action="store_true", help="run without predictions")
    parser.add_argument(
        "--predictor-dir",
        type=Path,
        default=Path("var/predictor/default"),
        help="built (or reused) here before the gateway starts",
    )
    return parser.parse_args(argv)


def prepare_model(work_dir: Path, tokenizer_dir: Path) -> Path:
    """A random tiny Llama saved like a real model directory, reused across runs."""
    model_dir = work_dir.parent / "models" / MODEL_NAME
    if not (model_dir / "model.safetensors").is_file():
        print(f"building a random {MODEL_NAME} in {model_dir} ...", flush=True)
        make_model_dir(model_dir, "llama", tokenizer_dir)
    return model_dir


def write_federation(work_dir: Path, model_dir: Path, sites: list[ManagedProcess]) -> Path:
    entries = [
        {
            "name": name,
            "cloud": cloud,
            "region": region,
            "endpoint": f"127.0.0.1:{site.port}",
            "model": MODEL_NAME,
        }
        for (name, cloud, region), site in zip(DEMO_SITES, sites, strict=True)
    ]
    federation = {"models": [{"name": MODEL_NAME, "tokenizer": str(model_dir)}], "sites": entries}
    path = work_dir / "federation.json"
    path.write_text(json.dumps(federation, indent=2))
    return path


def build_workload(args: argparse.Namespace, tokenizer_dir: Path) -> list[tuple[str, int]]:
    """Random Alpaca prompts; each asks for as many tokens as its reference answer had."""
    records = load_corpus("alpaca_random", args.data_dir)
    rng = random.Random(args.seed)
    tokenizer = load_tokenizer(tokenizer_dir)
    picked = rng.sample(records, args.requests)
    return [
        (r.prompt, max(1, min(args.max_tokens, len(tokenizer.encode(r.response))))) for r in picked
    ]


async def send_all(
    base_url: str, workload: list[tuple[str, int]], concurrency: int
) -> list[DemoResult]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

        async def one(index: int, prompt: str, max_tokens: int) -> DemoResult:
            stream = index % 3 == 0
            body = {
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.8,
                "seed": index,
                "stream": stream,
                "ignore_eos": True,
            }
            async with limit:
                started = time.perf_counter()
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as response:
                        payload = await response.aread()
                except httpx.HTTPError as exc:
                    return DemoResult(False, "-", stream, time.perf_counter() - started, str(exc))
                ok = response.status_code == 200 and b'"error"' not in payload
                site = response.headers.get("x-fedllm-site", "-")
                detail = "" if ok else payload.decode(errors="replace")[:200]
                return DemoResult(ok, site, stream, time.perf_counter() - started, detail)

        return await asyncio.gather(*(one(i, p, m) for i, (p, m) in enumerate(workload)))


async def read_totals(database_url: str) -> list[SiteTotals]:
    engine = create_engine(database_url)
    try:
        return await site_totals(create_sessionmaker(engine))
    finally:
        await engine.dispose()


def print_table(totals: list[SiteTotals]) -> None:
    header = (
        "site",
        "cloud",
        "region",
        "requests",
        "failed",
        "prompt tok",
        "completion tok",
        "predicted tok",
    )
    rows = [
        (
            t.site,
            t.cloud,
            t.region,
            str(t.requests),
            str(t.failed),
            str(t.prompt_tokens),
            str(t.completion_tokens),
            str(t.predicted_tokens),
        )
        for t in totals
    ]
    all_rows = [*rows, ("total", "", "", *(str(sum(int(r[i]) for r in rows)) for i in range(3, 8)))]
    widths = [max(len(row[i]) for row in (header, *all_rows)) for i in range(len(header))]
    line = "-+-".join("-" * w for w in widths)
    for index, row in enumerate((header, *all_rows)):
        if index in (1, len(all_rows)):
            print(line)
        print(
            " | ".join(
                cell.ljust(w) if i < 3 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    work_dir = args.work_dir.resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(work_dir, args.tokenizer_dir)
    predictor_dir = args.predictor_dir.resolve()
    if not args.no_predictor:
        build_default(predictor_dir, data_dir=args.data_dir, tokenizer_dir=args.tokenizer_dir)
    database = work_dir / "gateway.db"
    for stale in work_dir.glob("gateway.db*"):
        stale.unlink()
    database_url = f"sqlite+aiosqlite:///{database}"
    processes: list[ManagedProcess] = []
    try:
        # Start all sites first, then wait: their start-ups (imports, model load) overlap.
        for name, _, _ in DEMO_SITES:
            processes.append(
                spawn_site(
                    model_dir=model_dir, site_name=name, model_name=MODEL_NAME, log_dir=work_dir
                )
            )
        for process in processes:
            wait_until_serving(process)
        federation = write_federation(work_dir, model_dir, processes)
        gateway_env = {} if args.no_predictor else {"GATEWAY_PREDICTOR_DIR": str(predictor_dir)}
        gateway = start_gateway(
            env=gateway_env,
            federation_file=federation,
            database_url=database_url,
            log_dir=work_dir,
            expect_healthy_sites=len(DEMO_SITES),
        )
        processes.append(gateway)
        base_url = f"http://127.0.0.1:{gateway.port}"
        print(f"gateway {base_url} with {len(DEMO_SITES)} sites; sending {args.requests} prompts")
        workload = build_workload(args, args.tokenizer_dir)
        sent = time.perf_counter()
        results = asyncio.run(send_all(base_url, workload, args.concurrency))
        elapsed = time.perf_counter() - sent
        print_table(asyncio.run(read_totals(database_url)))
        ok = sum(r.ok for r in results)
        print(
            f"\n{ok}/{len(results)} requests succeeded ({sum(r.stream for r in results)} "
            f"streamed) in {elapsed:.1f}s; demo wall time {time.perf_counter() - started:.1f}s"
        )
        for failure in (r for r in results if not r.ok):
            print(f"  failed: {failure.detail}", file=sys.stderr)
        if args.keep_running:
            print(f"services keep running: {base_url} (logs in {work_dir}); Ctrl-C stops them")
            _wait_forever()
        return 0 if ok == len(results) else 1
    finally:
        for process in reversed(processes):
            process.stop()


def _wait_forever() -> None:
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping")


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(parse_args(argv)))


if __name__ == "__main__":
    main()
