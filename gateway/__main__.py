"""Runs the gateway: `python -m gateway` (settings from GATEWAY_* environment variables)."""

from __future__ import annotations

import gc
import logging
import os

import uvicorn

from gateway.api.http_protocol import bounded_protocol
from gateway.api.sse_stream import with_body_send
from gateway.app import create_app
from gateway.log_setup import configure_logging
from gateway.settings import GatewaySettings, is_loopback
from gateway.workers import Supervisor, listening_socket

log = logging.getLogger("gateway")

# The collector's thresholds while serving. The heap of a busy gateway is mostly its requests'
# live objects, which the defaults (700, 10, 10) walked in a full collection every ~2 s: at
# 1,024 streams the collector took ~16% of the gateway's core (58 full collections in 2 min).
# At these it takes ~1.5% with the heap the same size (~190k tracked objects, RSS ~300 MiB),
# and the gateway's CPU per delivered token fell from 12.8-13.4 µs to 11.7
# (bench/results/serving_path/serving_path_cpu_gc.md). Cycles are still collected: a young
# collection every 20,000 allocations, a full one every 50 of the middle generation's.
GC_THRESHOLDS = (20_000, 10, 50)


def use_batch_scheduling() -> bool:
    """SCHED_BATCH for the calling thread and every thread it starts afterwards (the policy is
    inherited), so call it before any. Why: each message a site sends makes grpc.aio's poller
    thread wake and hand it to the event loop; under the default policy that wake-up preempts
    the loop at once. On one core at 32 concurrent requests that was ~22 involuntary switches
    of the loop per request and a quarter of the process's CPU in the kernel; batched, 0.4 a
    request, and 15% less CPU per request (docs/federation-bench.md, sixth session). Batch
    threads still get their fair share of the core, only not the moment they wake. Returns
    whether the policy was set."""
    if not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError as exc:
        log.warning("could not switch to SCHED_BATCH (%s); running under the default policy", exc)
        return False
    return True


def main() -> None:
    settings = GatewaySettings.from_env()
    if settings.server.workers > 1:
        configure_logging(settings)
        raise SystemExit(Supervisor(settings).run())
    batch = settings.server.batch_scheduling and use_batch_scheduling()
    app = create_app(settings)
    configure_logging(settings)
    log.info("scheduling policy: %s", "SCHED_BATCH" if batch else "the default")
    if not (settings.access.require_api_keys or is_loopback(settings.server.host)):
        log.warning(
            "OPEN ACCESS: GATEWAY_ALLOW_OPEN_ACCESS=true and %s is not loopback: anyone who "
            "reaches this port is served without an API key, outside every key's limits",
            settings.server.host,
        )
    # The modules and the app live as long as the process: out of the collector's sight, they cost
    # nothing in its collections while serving (each full one would walk them all) or at exit.
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    proxies = settings.access.proxy_networks()
    if proxies:
        log.info("X-Forwarded-For is believed from %s", ", ".join(proxies))
    config = uvicorn.Config(
        with_body_send(app),
        host=settings.server.host,
        port=settings.server.port,
        log_level=settings.server.log_level.lower(),
        access_log=False,
        # uvloop and httptools: the event loop and HTTP parser in C, a fifth of the gateway's
        # CPU per request less than asyncio's loop with h11
        # (bench/results/gateway_overhead/gateway_overhead.md).
        loop="uvloop",
        http=bounded_protocol(settings.limits),
        # Idle connections (new ones too, gateway/api/http_protocol.py) close after this long.
        timeout_keep_alive=settings.limits.keep_alive_timeout_s,
        # uvicorn believes X-Forwarded-For from 127.0.0.1 unless told otherwise: anyone reaching
        # the gateway through a proxy, tunnel or sidecar on its host could then be any address
        # (issue 48). Only the proxies the operator names are believed.
        proxy_headers=bool(proxies),
        forwarded_allow_ips=list(proxies),
    )
    server = settings.server
    sockets = [listening_socket(server.host, server.port, True)] if server.reuse_port else None
    uvicorn.Server(config).run(sockets=sockets)


if __name__ == "__main__":
    main()
