"""How fast an overloaded site answers what the gateway's health decisions read: a real site
(tiny random Llama on the CPU, or any model/device by flag) is flooded with thousands of long
Generate streams from a separate process, while this process times the health Check, Info and
the gaps between pushed load reports (the gateway's three signals, gateway/sites/health.py).

    python -m bench.health_overload --out bench/results/health_overload/<name>.json

On a GPU: add `--model DIR --site-arg=--device --site-arg=cuda --site-arg=--max-num-seqs
--site-arg=64` and a larger --streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from devtools.launch import start_site
from fedllm_contract.proto import site_pb2, site_pb2_grpc

SERVICE = "fedllm.site.v1.SiteEngine"


async def _flood_async(port: int, streams: int, max_tokens: int, seconds: float) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = site_pb2_grpc.SiteEngineStub(channel)

        async def one(i: int) -> None:
            request = site_pb2.GenerateRequest(
                request_id=f"flood-{i}",
                prompt_token_ids=[(i * 7 + j) % 5000 + 10 for j in range(64)],
                sampling=site_pb2.SamplingParams(max_tokens=max_tokens),
            )
            try:
                async for _chunk in stub.Generate(request, timeout=seconds + 30):
                    pass
            except grpc.aio.AioRpcError:
                pass

        tasks = [asyncio.create_task(one(i)) for i in range(streams)]
        await asyncio.sleep(seconds)
        for task in tasks:
            task.cancel()


def _flood(port: int, streams: int, max_tokens: int, seconds: float) -> None:
    asyncio.run(_flood_async(port, streams, max_tokens, seconds))


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {
        "n": len(values),
        "p50_ms": round(statistics.median(ordered) * 1000, 1),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 1),
        "max_ms": round(ordered[-1] * 1000, 1),
    }


async def _probe_beside_flood(
    port: int, seconds: float, deadline_s: float, streams: int, max_tokens: int, own: bool
) -> dict[str, object]:
    """The probe on the same event loop as the flood's streams, as the gateway's health checks
    share its loop with every request it relays."""
    flood = asyncio.create_task(_flood_async(port, streams, max_tokens, seconds + 10))
    await asyncio.sleep(5.0)
    try:
        return await _probe(port, seconds, deadline_s, own)
    finally:
        flood.cancel()


async def _probe(
    port: int, seconds: float, deadline_s: float, own_connection: bool = False
) -> dict[str, object]:
    health_s: list[float] = []
    info_s: list[float] = []
    failures = {"health": 0, "info": 0}
    gaps: list[float] = []
    queued: list[int] = []
    loop_lag: list[float] = []
    # gRPC shares one connection between channels of equal arguments (the flood's, in the
    # same-loop case); a local subchannel pool gives the probe its own, as the gateway's
    # health checks have (gateway/sites/grpc_client.py).
    options = [("grpc.use_local_subchannel_pool", 1)] if own_connection else []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        stub = site_pb2_grpc.SiteEngineStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        end = time.monotonic() + seconds

        async def timed(kind: str, call: Callable[[], Awaitable[object]], out: list[float]) -> None:
            began = time.perf_counter()
            try:
                await call()
                out.append(time.perf_counter() - began)
            except grpc.aio.AioRpcError:
                failures[kind] += 1

        async def polls() -> None:
            while time.monotonic() < end:
                await timed(
                    "health",
                    lambda: health.Check(
                        health_pb2.HealthCheckRequest(service=SERVICE), timeout=deadline_s
                    ),
                    health_s,
                )
                await timed(
                    "info", lambda: stub.Info(site_pb2.InfoRequest(), timeout=deadline_s), info_s
                )
                began = time.perf_counter()
                await asyncio.sleep(0.25)
                loop_lag.append(time.perf_counter() - began - 0.25)

        async def reports() -> None:
            call = stub.StreamLoad(site_pb2.LoadStreamRequest(interval_ms=250))
            last = None
            async for report in call:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                queued.append(report.queued_requests)
                if time.monotonic() >= end:
                    call.cancel()
                    return

        await asyncio.gather(polls(), reports())
    return {
        "health_check": _summary(health_s),
        "info": _summary(info_s),
        "failures": failures,
        "load_report_gap": _summary(gaps),
        "probe_loop_lag": _summary(loop_lag),
        "queued_requests_max": max(queued, default=0),
        "queued_requests_median": statistics.median(queued) if queued else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model dir (default: a tiny random Llama)")
    parser.add_argument("--tokenizer-dir", type=Path, default=Path("../shared/tokenizers/gpt2"))
    parser.add_argument("--streams", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--deadline-s", type=float, default=30.0)
    parser.add_argument("--site-arg", action="append", default=[])
    parser.add_argument(
        "--same-loop",
        action="store_true",
        help="flood from the probe's own event loop (the gateway's case) instead of a process",
    )
    parser.add_argument(
        "--own-connection",
        action="store_true",
        help="with --same-loop: the probe on a connection of its own, not the flood's",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="health-overload-"))
    model = args.model
    if model is None:
        from site_engine.make_model import make_model_dir

        model = make_model_dir(work / "tiny", "llama", args.tokenizer_dir)
    site_args = args.site_arg or ["--max-num-seqs", "8"]
    site = start_site(
        model_dir=model,
        site_name="overload",
        model_name="tiny",
        log_dir=work,
        extra_args=[*site_args, "--max-queued-requests", str(args.streams * 2)],
    )
    try:
        idle = asyncio.run(_probe(site.port, 3.0, args.deadline_s))
        if args.same_loop:
            loaded = asyncio.run(
                _probe_beside_flood(
                    site.port,
                    args.seconds,
                    args.deadline_s,
                    args.streams,
                    args.max_tokens,
                    args.own_connection,
                )
            )
        else:
            loaded = _probe_in_own_process(site.port, args)
    finally:
        site.stop()
    result = {"streams": args.streams, "max_tokens": args.max_tokens, "site_args": site_args,
              "same_loop": args.same_loop, "own_connection": args.own_connection,
              "idle": idle, "overloaded": loaded}  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def _probe_in_own_process(port: int, args: argparse.Namespace) -> dict[str, object]:
    flood = multiprocessing.Process(
        target=_flood, args=(port, args.streams, args.max_tokens, args.seconds + 10)
    )
    flood.start()
    time.sleep(5.0)  # the streams reach the site and queue
    try:
        return asyncio.run(_probe(port, args.seconds, args.deadline_s))
    finally:
        flood.terminate()
        flood.join()


if __name__ == "__main__":
    main()
