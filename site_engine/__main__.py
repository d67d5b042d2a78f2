"""Starts a site engine: `python -m site_engine --model DIR --port 50051 --site-name NAME`.

Every flag can also come from the environment (SITE_MODEL_DIR, SITE_PORT, ...). Prints
`READY port=N` on stdout once it serves, so supervisors and tests can wait for it. With `--pool`
it prepares what needs no device, prints `POOLED pid=N` and serves once claimed on stdin
(site_engine/pool.py). The start-up log's `start phases:` line and the metric
fedllm_site_start_phase_seconds say where its start went (site_engine/start_phases.py). A model
directory laid out as a sentence-transformers model (all-MiniLM-L6-v2) is served as an embedding
model (`--task embed`, or `auto`, the default, tells from the directory).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

import torch
from grpc_health.v1 import health_pb2

from fedllm_contract.env_settings import add_flags
from fedllm_contract.tokenizer import tokenizer_fingerprint
from site_engine.embedding.batcher import (
    EmbeddingBatcher,
    EmbeddingLimits,
    embedding_batch_defaults,
)
from site_engine.embedding.layout import is_embedding_model
from site_engine.embedding.runner import load_embedding_runner
from site_engine.embedding_http import EmbeddingFace
from site_engine.engine.core.api import Engine, StructuredOutputUnavailable
from site_engine.engine.lora.registry import LoraSettings
from site_engine.engine.memory_plan import batch_defaults
from site_engine.engine.paged_engine import EngineConfig, PagedEngine, plan_kv
from site_engine.engine_service import EngineService, OnDemandReserve
from site_engine.grpc_embedding import EmbeddingServicer
from site_engine.grpc_server import SERVICE_NAME, SiteIdentity, SiteServicer, start_server
from site_engine.idle_work import IdleGate, IdleWork
from site_engine.kv_lending_access import LendingAccess
from site_engine.metrics import MeteredEngine, MetricsServer, SiteMetrics, serve_metrics
from site_engine.model_loading import LoadedModel, load_model, resolve_model_dir
from site_engine.openai_http import Face, HttpFace, HttpServer, serve_http
from site_engine.pool import (
    Prepared,
    announce_pooled,
    apply_claim_env,
    planned_kv,
    prepare,
    read_claim,
    split_pool_args,
    take_device,
)
from site_engine.settings import SiteSettings
from site_engine.start_phases import StartPhaseCollector, StartPhases
from site_engine.tls import load_server_tls

if TYPE_CHECKING:
    from site_engine.finetune.jobs import FineTuneJobs

log = logging.getLogger("site_engine")


def parse_args(argv: list[str] | None = None) -> SiteSettings:
    """The settings from the environment, each overridden by its flag where given (a flag per
    SiteSettings field: fedllm_contract/env_settings.py's add_flags)."""
    parser = argparse.ArgumentParser(prog="python -m site_engine", description=__doc__)
    add_flags(parser, SiteSettings)
    return SiteSettings.load(**vars(parser.parse_args(argv)))


def engine_config(settings: SiteSettings, device: torch.device) -> EngineConfig:
    """The engine's settings; batch limits the operator left unset come from the device (vLLM's
    defaults on a GPU), and the log says which were chosen and why."""
    total, name = 0, ""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        name = torch.cuda.get_device_name(device)
    defaults = batch_defaults(device.type, total, name)
    seqs, tokens = settings.max_num_seqs, settings.max_num_batched_tokens
    if seqs is None or tokens is None:
        seqs = defaults.max_num_seqs if seqs is None else seqs
        tokens = defaults.max_num_batched_tokens if tokens is None else tokens
        log.info(
            "batch limits: max_num_seqs=%d, max_num_batched_tokens=%d (%s, for what was not set)",
            seqs,
            tokens,
            defaults.reason,
        )
    return EngineConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=tokens,
        block_size=settings.block_size,
        kv_cache_bytes=settings.kv_cache_mib << 20,
        policy=settings.policy,
        prefix_caching=settings.prefix_caching,
        model_name=settings.model_name,
        host_kv_cache_bytes=int(settings.host_kv_cache_gib * (1 << 30)),
        host_kv_offload_bytes_per_step=settings.host_kv_offload_bytes_per_step,
        host_kv_active_window_steps=settings.host_kv_active_window_steps,
        grammar_compile_threads=settings.grammar_compile_threads,
        grammar_compile_timeout_s=settings.grammar_compile_timeout_s,
        background_step_tokens=settings.deferral_bound_tokens,
        background_step_slack=settings.deferral_bound_slack,
        lora=lora_settings(settings),
        finetune_reserve_bytes=settings.finetune_reserve_bytes,
        finetune_reserve_on_demand=settings.finetune_reserve_on_demand,
        lazy_graphs=settings.lazy_graphs,
    )


def lora_settings(settings: SiteSettings) -> LoraSettings | None:
    if settings.lora_dir is None:
        return None
    return LoraSettings(
        settings.lora_dir,
        max_loras=settings.max_loras,
        max_cpu_loras=settings.max_cpu_loras,
        max_cpu_bytes=int(settings.max_cpu_lora_gib * (1 << 30)),
        max_rank=settings.max_lora_rank,
        max_loads=settings.max_lora_loads,
        unified=settings.lora_unified_slots,
    )


def _package_version() -> str:
    try:
        return version("fedllm")
    except PackageNotFoundError:
        return "dev"


def task_of(settings: SiteSettings) -> str:
    """`generate` or `embed`: the operator's word, else what the model directory is."""
    if settings.task != "auto":
        return settings.task
    return "embed" if is_embedding_model(resolve_model_dir(settings.model_dir)) else "generate"


@dataclass(slots=True)
class Serving:
    """What a started site runs besides its gRPC server, stopped in order at the end."""

    stop_work: Callable[[], None]
    http_server: HttpServer | None = None
    metrics_server: MetricsServer | None = None


# What builds the model and its engine (`_engine`; a benchmark passes a synthetic engine's).
EngineBuilder = Callable[
    [SiteSettings, StartPhases, Prepared | None], tuple[LoadedModel, PagedEngine]
]


async def serve(
    settings: SiteSettings,
    phases: StartPhases | None = None,
    prepared: Prepared | None = None,
    build_engine: EngineBuilder | None = None,
) -> None:
    phases = phases if phases is not None else StartPhases.since_process_start()
    tls = load_server_tls(settings)  # before the model loads: a bad file fails at once
    torch.set_num_threads(settings.torch_threads)
    # The engine thread lets the GIL go whenever it waits for the GPU, and inside every NumPy
    # call over more than 500 elements (NumPy's threshold): past ~500 running rows, each NumPy
    # call of its step over the rows. The event loop, busy serving streams, takes the GIL each
    # time, and the engine thread gets it back only when the loop is made to drop it, one switch
    # interval later. At CPython's 5 ms a busy loop held an 8.5 ms GPU step to 16 ms at p50 (8.7
    # at 0.5 ms). On the CPU (bench.serving_path.gil_handoff) the scheduler's step over 1,000 rows
    # beside a thread that never waits takes 0.42 ms alone, 109 at 5 ms, 14.8 at 0.5 ms and 3.2
    # at 50 us (over 400 rows, no difference). On an H200, a 1B site alone at ~180 req/s (at most
    # ~560 rows): TPOT p50 6.3-7.0 ms at 50 us against 6.9-8.1 at 0.5 ms over eight runs, a gain
    # inside their spread (bench/results/serving_path/serving_path_r91.md). The default stays
    # 0.5 ms: a forced switch waits for the other thread to be scheduled, ten times as often at
    # 50 us, and on a 2-core host shared by many processes (the CI's) that was not measured. The
    # loop is only preempted when another thread waits.
    sys.setswitchinterval(settings.switch_interval_us * 1e-6)
    servicer: SiteServicer | EmbeddingServicer
    if task_of(settings) == "embed" and prepared is None:
        servicer, serving = start_embedding(settings)
    else:
        servicer, serving = start_generation(settings, phases, prepared, build_engine)
    phases.mark("service")
    server, health_servicer, port = await start_server(
        servicer,
        settings.host,
        settings.port,
        tls.credentials() if tls is not None else None,
    )
    phases.mark("grpc_up")
    # What start-up built (torch, transformers, the model) lives as long as the process: out of
    # the collector's sight, it costs no time in the collections while serving, nor in the one at
    # exit (a second per stop for a small model's site, most of its shutdown).
    gc.freeze()
    # One write: print() writes the text and its newline separately, and with unbuffered stdout a
    # log line from another thread could land between them.
    sys.stdout.write(f"READY port={port}\n")
    sys.stdout.flush()
    log.info("%s", phases.line())
    log.info(
        "site %s serving %s on %s:%d (%s)",
        settings.site_name,
        settings.model_name,
        settings.host,
        port,
        "mutual TLS" if tls is not None else "plaintext",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Tell health checkers first so no new work arrives, then let running streams end.
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if serving.http_server is not None:
        serving.http_server.stop()
    await server.stop(grace=5)
    serving.stop_work()
    if serving.metrics_server is not None:
        serving.metrics_server.stop()


def _identity(
    settings: SiteSettings,
    vocab_size: int,
    tokenizer: Any,
    device: str,
    fingerprint: str | None = None,
) -> SiteIdentity:
    return SiteIdentity(
        site_name=settings.site_name,
        model_name=settings.model_name,
        vocab_size=vocab_size,
        tokenizer_fingerprint=fingerprint or tokenizer_fingerprint(tokenizer),
        device=device,
        dtype=settings.dtype,
        version=_package_version(),
    )


def _http_face(settings: SiteSettings, face: Face) -> HttpServer | None:
    if not settings.http_port:
        return None
    server = serve_http(face, settings.host, settings.http_port)
    log.info("OpenAI-compatible API on http://%s:%d/v1", settings.host, settings.http_port)
    return server


def _engine(
    settings: SiteSettings, phases: StartPhases, prepared: Prepared | None
) -> tuple[LoadedModel, PagedEngine]:
    """The model on its device and its engine, each phase marked (module docstring)."""
    if prepared is not None:
        loaded = take_device(prepared, settings, phases)
        config = engine_config(settings, loaded.device)
        plan = planned_kv(prepared, loaded, settings, config)
    else:
        if torch.device(settings.device).type == "cuda":
            torch.cuda.init()  # type: ignore[no-untyped-call]
        phases.mark("device_init")
        loaded = load_model(
            settings.model_dir,
            device=settings.device,
            dtype=settings.dtype,
            tokenizer_dir=settings.tokenizer_dir,
        )
        phases.mark("weights_read")
        config = engine_config(settings, loaded.device)
        plan = plan_kv(loaded, config)
    phases.mark("memory_sizing")
    paged = PagedEngine(loaded, config, plan)
    phases.mark("kv_and_graphs")
    log.info("%s", paged.startup_report)
    if prepared is not None and prepared.grammars is not None:
        paged.adopt_grammars(prepared.grammars)
    # Now rather than for the first constrained request: it reads the whole vocabulary holding
    # the GIL (~1 s), which would hold up every request on the site then.
    began = time.monotonic()
    try:
        paged.grammars()
        log.info("grammar compiler ready in %.2f s", time.monotonic() - began)
    except StructuredOutputUnavailable as exc:
        log.warning("%s: constrained requests are refused, the rest is served", exc)
    phases.mark("grammar")
    return loaded, paged


def start_generation(
    settings: SiteSettings,
    phases: StartPhases,
    prepared: Prepared | None = None,
    build_engine: EngineBuilder | None = None,
) -> tuple[SiteServicer, Serving]:
    """A generative model's engine, its service and its optional metrics and HTTP face."""
    loaded, paged = (build_engine or _engine)(settings, phases, prepared)
    engine: Engine = paged
    metrics = SiteMetrics(settings.site_name) if settings.metrics_port else None
    if metrics is not None:
        metrics.registry.register(StartPhaseCollector(settings.site_name, phases))
        engine = MeteredEngine(engine, metrics)
    jobs = fine_tune_jobs(settings, loaded)
    idle = training_work(settings, jobs, paged) if jobs is not None else None
    on_unit = metrics.observe_idle_unit if metrics is not None else None
    if paged.graphs_pending:

        def graphs_ready(_: float) -> None:
            phases.after_ready("graphs_ready")

        paged.on_graphs_ready = graphs_ready
    service = EngineService(
        engine,
        loaded.tokenizer,
        settings.max_queued_requests,
        idle,
        on_idle_unit=on_unit,
        graphs=paged if paged.graphs_pending else None,
        reserve=(
            OnDemandReserve(paged, settings.finetune_reserve_bytes)
            if jobs is not None and settings.finetune_reserve_on_demand
            else None
        ),
    )
    fingerprint = prepared.tokenizer_fingerprint if prepared is not None else None
    identity = _identity(
        settings, loaded.vocab_size, loaded.tokenizer, str(loaded.device), fingerprint
    )
    # The gRPC boundary reads the adapter directory at each request (LoadAdapter adds to it).
    if adapters := paged.served_adapters():
        log.info("LoRA adapters served: %s", ", ".join(adapters))
    service.start()

    def stop_work() -> None:
        if jobs is not None:  # a file under way is read again at the next start
            jobs.close()
        service.stop()

    serving = Serving(stop_work)
    if metrics is not None:
        metrics.watch(service)
        serving.metrics_server = serve_metrics(metrics, settings.host, settings.metrics_port)
    face = HttpFace(service, settings.model_name, loaded.vocab_size)
    serving.http_server = _http_face(settings, face)
    access = LendingAccess(settings.gateway_identity)
    return SiteServicer(service, identity, jobs, settings.lora_dir, access), serving


def training_work(
    settings: SiteSettings, jobs: FineTuneJobs, paged: PagedEngine
) -> tuple[IdleWork, IdleGate]:
    """What the engine loop runs of the jobs, and when (SITE_FINETUNE_MODE)."""
    if settings.finetune_mode == "idle":
        gate = IdleGate(
            settings.finetune_max_step_ms / 1000, busy_share=settings.finetune_busy_share
        )
        return jobs, gate
    from site_engine.finetune.step_rows import StepRows
    from site_engine.finetune.step_work import NextStep, StepRowsWork, rows_gate

    bound_ms = settings.finetune_max_training_delay_ms
    limits = paged.limits
    next_step = NextStep(paged.token_budget, limits.max_num_seqs, limits.kv_block_size)
    work = StepRowsWork(jobs, StepRows(bound_ms), next_step, paged.stats)
    return work, rows_gate(bound_ms, next_step)


def piece_bound_ms(settings: SiteSettings) -> float:
    """The jobs' bound on one piece of training: the unit bound between steps, or in rows mode
    the share of the step's delay bound that the pieces are sized to."""
    if settings.finetune_mode == "idle":
        return settings.finetune_max_step_ms
    from site_engine.finetune.step_work import PIECE_SHARE

    return settings.finetune_max_training_delay_ms * PIECE_SHARE


def fine_tune_jobs(settings: SiteSettings, loaded: LoadedModel) -> FineTuneJobs | None:
    """The site's fine-tuning jobs (those on disk resume), or None where the reserve is 0."""
    if not settings.finetune_reserve_bytes:
        return None
    # Imported here: peft is needed only where fine-tuning is on.
    from site_engine.finetune.jobs import FineTuneJobs, FineTuneSettings

    jobs = FineTuneJobs(
        FineTuneSettings(
            settings.finetune_dir,
            settings.finetune_reserve_bytes,
            checkpoint_every=settings.finetune_checkpoint_every,
            max_step_ms=piece_bound_ms(settings),
            idle_unit_tokens=settings.finetune_idle_unit_tokens,
            max_dir_bytes=settings.finetune_dir_max_bytes,
            max_tokens=loaded.max_model_len,
            max_rank=settings.max_lora_rank,
        ),
        loaded.model,
        loaded.tokenizer,
        settings.model_name,
    )
    log.info(
        "fine-tuning jobs accepted (%s mode): %d bytes reserved, jobs in %s",
        settings.finetune_mode,
        settings.finetune_reserve_bytes,
        settings.finetune_dir,
    )
    return jobs


def start_embedding(settings: SiteSettings) -> tuple[EmbeddingServicer, Serving]:
    """An embedding model's runner and batcher, and its optional HTTP face (whose /metrics is
    its metrics: SITE_METRICS_PORT serves the generative engine's only)."""
    runner = load_embedding_runner(
        resolve_model_dir(settings.model_dir),
        device=settings.device,
        dtype=settings.dtype,
        tokenizer_dir=settings.tokenizer_dir,
    )
    inputs, tokens = embedding_batch_defaults(runner.device.type)
    limits = EmbeddingLimits(
        max_batch_inputs=settings.max_num_seqs or inputs,
        max_batch_tokens=settings.max_num_batched_tokens or tokens,
        max_queued_requests=settings.max_queued_requests,
    )
    layout = runner.layout
    batcher = EmbeddingBatcher(runner, limits, layout.max_seq_length, runner.vocab_size)
    log.info(
        "embedding model: %d dimensions, %s pooling%s, up to %d tokens an input; "
        "batches of %d inputs / %d padded tokens",
        layout.dimension,
        layout.pooling,
        ", normalized" if layout.normalize else "",
        layout.max_seq_length,
        limits.max_batch_inputs,
        limits.max_batch_tokens,
    )
    if settings.metrics_port:
        log.warning("SITE_METRICS_PORT is not served for an embedding model: read the HTTP "
                    "face's /metrics (SITE_HTTP_PORT)")  # fmt: skip
    identity = _identity(settings, runner.vocab_size, runner.tokenizer, str(runner.device))
    batcher.start()
    face = EmbeddingFace(batcher, runner.tokenizer, settings.model_name, layout.dimension)
    serving = Serving(batcher.stop, http_server=_http_face(settings, face))
    return EmbeddingServicer(batcher, identity, layout.dimension), serving


def main(argv: list[str] | None = None) -> None:
    phases = StartPhases.since_process_start()
    phases.mark("imports")
    given = sys.argv[1:] if argv is None else argv
    pool = split_pool_args(given)
    if pool is None:
        settings = parse_args(given)
        _log_config(settings)
        asyncio.run(serve(settings, phases))
        return
    settings = parse_args(pool.site_args)
    _log_config(settings)
    if task_of(settings) != "generate":
        sys.exit("--pool: a pooled site serves a generative model (not an embedding model)")
    prepared = prepare(settings, pool.plan_file)
    phases.mark("pool_prepare")
    announce_pooled()
    claim = read_claim(sys.stdin)
    if claim is None:
        log.info("the pool closed before a claim: exiting unused")
        return
    apply_claim_env(claim)
    phases.mark("pooled_wait")
    asyncio.run(serve(parse_args([*pool.site_args, *claim.args]), phases, prepared))


def _log_config(settings: SiteSettings) -> None:
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )


if __name__ == "__main__":
    main()
