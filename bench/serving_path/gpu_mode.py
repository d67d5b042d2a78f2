"""GPU mode: the real 1B-shaped engine served as users serve it, against the same engine driven
in process, on the same requests, in one call on one card.

- path: one `python -m site_engine` (Llama-3.2-1B shape, random bf16 weights, `max_num_seqs`
  1,024, 8,192-token steps, CUDA graphs captured before READY) behind bench.federation_real's
  one-way delay proxy and one `python -m gateway` (SQLite, completion_cost, the federation
  bench's settings: bench.federation_real.federation.GATEWAY), started by that bench's
  Federation; open-loop Poisson arrivals of streaming `/v1/completions` from `clients`
  processes, at each rate for `duration_s`, what is open `drain_s` after the last arrival cut.
- engine: the site stopped, the same model loaded here into a PagedEngine of the same settings,
  warmed up, and the very same requests (prompt ids, max_tokens with ignore_eos, arrival times)
  added as they arrive (bench.engine.engine_runs.measure_run, the in-process open loop of
  bench.engine.open_loop), each rate in turn on the one engine.

The workload is bench.federation_real's ShareGPT-like one (log-normal prompts of median 180
tokens and answers of median 220, capped at 2,048 and 1,024), with each rate's own marker
tokens in front of its prompts (no rate hits another's prefix cache). Both sides are summarised
by bench.engine.metrics.summarize_run over per-request timings from each request's arrival
(output tokens/s: every token delivered over the time from the first arrival to the last
answer's end), so `path_vs_engine_tokens` compares like with like.

`--preset cpu` runs the same wiring with a tiny model on this machine's CPU (two low rates, a
few seconds each): a smoke test of the mode, no figure to quote.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.common import write_results
from bench.engine.engine_runs import measure_run, warm_up
from bench.engine.harness import Progress
from bench.engine.open_loop import drain_engine
from bench.engine.paths import shared_path
from bench.federation_real.federation import GATEWAY, Federation
from bench.federation_real.models import ensure_models, model_dir
from bench.federation_real.presets import CPU, Preset, SiteSetup, gpu_preset
from bench.federation_real.workload import WorkloadSpec, build, describe, marked
from bench.loadgen.workload import Request
from bench.serving_path.gpu_path import figures, line, open_loop, rate_figures
from bench.serving_path.report import gpu_markdown
from bench.serving_path.servers import log_problems, raise_open_files
from devtools.forkserver import FORK_SERVER_ENV
from fedllm_contract.tokenizer import load_tokenizer
from fedsim.engine_trace import WorkloadRequest

WARM_UP = 16


@dataclass(frozen=True, slots=True)
class GpuSetup:
    """A run: bench.federation_real's preset of one site (its model, batch limits and delay, the
    workload's lengths, the seconds of arrivals and drain), the rates, the client processes."""

    preset: Preset
    rates: tuple[float, ...]
    clients: int
    seed: int = 0

    @property
    def site(self) -> SiteSetup:
        return self.preset.sites[0]


def setup_of(args: argparse.Namespace) -> GpuSetup:
    """--preset's setup (gpu: the 1B shape at 1,024 sequences and 8,192 tokens a step, 5 ms one
    way, 160 and 256 req/s for 20 s each; cpu: a tiny model, 2 and 4 req/s for 3 s), with the
    command's overrides."""
    if args.preset == "cpu":
        site = SiteSetup("site0-tiny", "tiny", 5.0, 8, 256, kv_cache_mib=16)
        base, rates, duration, clients = CPU, (2.0, 4.0), 3.0, 2
    else:
        site = SiteSetup("site0-1b", "llama1b", 5.0, 1024, 8192, gpu=0)
        base, rates, duration, clients = gpu_preset(1), (160.0, 256.0), 20.0, 8
    if args.one_way_ms is not None:
        site = replace(site, one_way_ms=args.one_way_ms)
    rates = tuple(args.rates) if args.rates else rates
    preset = replace(
        base, sites=(site,), rate_rps=rates[0], duration_s=args.duration_s or duration,
        drain_s=args.drain_s if args.drain_s is not None else 20.0, arms=("completion_cost",),
    )  # fmt: skip
    return GpuSetup(preset, rates, args.clients or clients, args.seed)


def rate_requests(setup: GpuSetup, rate: float, vocab: int) -> list[Request]:
    """The rate's requests, its own marker ids in front of every prompt."""
    preset = setup.preset
    spec = WorkloadSpec(
        "sharegpt", rate, preset.duration_s, setup.seed, vocab, preset.length_scale,
        preset.max_prompt_tokens, preset.max_answer_tokens, preset.block_tokens,
    )  # fmt: skip
    return marked(build(spec), f"rate-{rate:g}", vocab)


def path_phase(
    setup: GpuSetup,
    work: Path,
    tokenizer_dir: Path,
    by_rate: dict[float, list[Request]],
    extra_env: dict[str, str],
    log: Progress,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every rate through the site and the gateway (module docstring): per rate its figures,
    refusals, cut-offs and each process's CPU per delivered token; the servers' log problems."""
    preset = setup.preset
    models = ensure_models(preset, work, tokenizer_dir)
    log(f"model ready: {sorted(models)}")
    federation = Federation(preset, work, models, tokenizer_dir)
    vocab = len(load_tokenizer(tokenizer_dir))
    out: dict[str, Any] = {}
    try:
        federation.start(timeout_s=900 if preset.device == "cuda" else 180)
        gateway = federation.start_gateway("serving_path", GATEWAY, extra_env)
        site = federation.sites[setup.site.name]
        assert federation.proxy is not None
        pids = {"site": site.popen.pid, "gateway": gateway.popen.pid,
                "delay_proxy": federation.proxy.pid}  # fmt: skip
        log(f"site and gateway serving; warm-up of {WARM_UP} requests")
        first = marked(by_rate[setup.rates[0]][:WARM_UP], "warm-up", vocab)
        open_loop(
            gateway.port, [replace(r, at_s=0.1 * i) for i, r in enumerate(first)], 1, 60, pids
        )
        for rate, requests in by_rate.items():
            if not federation.wait_idle(timeout_s=120):
                log("the site still had requests 120 s after the last rate")
            log(f"path @ {rate:g} req/s: {len(requests)} requests")
            drain = preset.drain_s
            sent, cpu, start = open_loop(gateway.port, requests, setup.clients, drain, pids)
            out[f"{rate:g}"] = rate_figures(requests, sent, cpu, start, rate)
            log(f"  {line(out[f'{rate:g}'])}")
        gateway.stop(timeout_s=30)
        logs = {"gateway": log_problems(gateway.log_path), "site": log_problems(site.log_path)}
    finally:
        federation.close()
    return out, logs


def engine_phase(
    setup: GpuSetup,
    work: Path,
    by_rate: dict[float, list[Request]],
    log: Progress,
) -> dict[str, Any]:
    """The same requests into a PagedEngine of the site's settings, in this process."""
    import torch

    from site_engine.engine.paged_engine import EngineConfig, PagedEngine
    from site_engine.model_loading import load_model

    preset, site = setup.preset, setup.site
    device = "cpu" if site.gpu is None else "cuda"
    if device == "cpu":
        torch.set_num_threads(1)  # as the site runs (--torch-threads 1)
    loaded = load_model(model_dir(work, site.shape), device=device, dtype=preset.dtype)
    config = EngineConfig(
        max_num_seqs=site.max_num_seqs,
        max_num_batched_tokens=site.max_num_batched_tokens,
        kv_cache_bytes=(site.kv_cache_mib or 0) << 20,
    )
    engine = PagedEngine(loaded, config)
    log(f"in-process engine ready: {engine.startup_report}")
    warm_up(engine, len(loaded.tokenizer), min(8, site.max_num_seqs), setup.seed)
    out: dict[str, Any] = {}
    for rate, requests in by_rate.items():
        workload = [
            WorkloadRequest(r.id, r.source, i, r.prompt_token_ids, r.answer_tokens,
                            r.answer_tokens, False)
            for i, r in enumerate(requests)
        ]  # fmt: skip
        summary, _ = measure_run(
            engine, loaded, workload, config, name=f"engine@{rate:g}",
            arrivals=[r.at_s for r in requests], poisson_rate=rate,
            budget_s=max(r.at_s for r in requests) + preset.drain_s, log=log,
        )  # fmt: skip
        drain_engine(engine, [r.request_id for r in workload])
        cut = summary.requests - summary.completed
        out[f"{rate:g}"] = figures(summary) | {"refused": summary.rejected, "cut": cut}
        log(f"engine @ {rate:g} req/s: {line(out[f'{rate:g}'])}")
    return out


def headline(path: dict[str, Any], engine: dict[str, Any]) -> dict[str, Any]:
    """Issue 74's keys, {rate: value} each."""
    return {
        "path_vs_engine_tokens": {
            rate: row["output_tokens_per_s"] / engine[rate]["output_tokens_per_s"]
            for rate, row in path.items()
            if engine.get(rate, {}).get("output_tokens_per_s")
        },
        "ttft_p99_s": {rate: row["ttft_p99_s"] for rate, row in path.items()},
        "refused": {rate: row["refused"] for rate, row in path.items()},
        "cut": {rate: row["cut"] for rate, row in path.items()},
    }


def gpu_main(args: argparse.Namespace, command: str, log: Progress) -> Path:
    """The module docstring's run; its results file (written after each phase)."""
    setup = setup_of(args)
    if setup.preset.device == "cuda":
        os.environ.pop(FORK_SERVER_ENV, None)  # CUDA in a forked site is not safe
    raise_open_files(8192)
    tokenizer_dir = shared_path(args.tokenizer_dir, "tokenizers", "gpt2")
    vocab = len(load_tokenizer(tokenizer_dir))
    by_rate = {rate: rate_requests(setup, rate, vocab) for rate in setup.rates}
    payload: dict[str, Any] = {
        "mode": "gpu",
        "complete": False,
        "setup": asdict(setup),
        "gateway": asdict(GATEWAY) | {"extra_env": args.gateway_env},
        "workload": {f"{rate:g}": describe(requests) for rate, requests in by_rate.items()},
    }
    save = _saver(args.name or f"serving_path_gpu_{args.preset}", command, args.out_dir, log)
    payload["path"], payload["logs"] = path_phase(
        setup, args.work_dir, tokenizer_dir, by_rate, args.gateway_env, log
    )
    save(payload)
    if not args.skip_engine:
        payload["engine"] = engine_phase(setup, args.work_dir, by_rate, log)
        payload |= headline(payload["path"], payload["engine"])
    payload["card"] = _card(setup.preset)
    payload["complete"] = True
    return save(payload)


def _card(preset: Preset) -> str:
    if preset.device == "cpu":
        return "cpu"
    import torch

    return torch.cuda.get_device_name(0)


def _saver(
    name: str, command: str, out_dir: Path, log: Progress
) -> Callable[[dict[str, Any]], Path]:
    def save(payload: dict[str, Any]) -> Path:
        path = write_results(name, payload, gpu_markdown(payload), command, out_dir)
        log(f"wrote {path}")
        return path

    return save
