"""Adapts a served model's length predictor to what the gateway saw, and registers the result.

    python -m gateway.retrain_predictor --database-url URL [--model NAME]
        [--mode retrain|calibrate] [--activate if-better|always|never] [--out DIR]
        [--mix-base-data] [--min-samples 50]
    python -m gateway.retrain_predictor --if-drifted [--model NAME]   # only drifted models
    python -m gateway.retrain_predictor --job ID        # one queued job (the gateway's worker)
    python -m gateway.retrain_predictor --run-queued    # every queued job, then exit

It reads the collected (prompt, completion tokens) samples and builds a candidate from the
active version (predictor.retrain): `calibrate` refits the map of its lengths onto the served
scale (seconds); `retrain` fine-tunes it, warm-started from its weights, then calibrates
(minutes). The gate scores the candidate on samples it never saw against the active version,
the served-mean constant and TF-IDF; with `--activate if-better` it is activated only if its MAE
of expected tokens beats all three. The decision and its numbers are stored with the version in
the registry. Gateways switch to an activated version without a restart
(GATEWAY_PREDICTOR_POLL_S). With --model, the version is that model's own (it starts from the
model's active version, else the default's) and learns from that model's samples alone.
`--if-drifted` judges each served model's rolling error by the GATEWAY_DRIFT_* settings and
retrains the drifted ones; it, `--job` and `--run-queued` record their work as retrain jobs
(table retrain_jobs, GET /admin/api/retrain-jobs).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from gateway.db.session import create_engine, create_sessionmaker
from gateway.drift_settings import RETRAIN_MODES
from gateway.retrain_runs import (
    AdaptOptions,
    RunRefused,
    Sessions,
    adapt,
    retrain_drifted,
    run_claimed,
    under,
)
from gateway.stores.retrain_jobs import RetrainJobStore


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.retrain_predictor", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--database-url", default=os.environ.get("GATEWAY_DATABASE_URL"))
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default: var/predictor/<time>; with --run-queued or --if-drifted, the directory "
        "each job's own goes under",
    )
    parser.add_argument("--base", type=Path, default=None, help="default: the active version")
    parser.add_argument(
        "--model",
        default=None,
        help="retrain this served model's own predictor, on its samples alone (default: the "
        "default predictor, on every model's samples)",
    )
    parser.add_argument("--activate", choices=("if-better", "always", "never"), default="if-better")
    parser.add_argument("--mode", choices=RETRAIN_MODES, default="retrain")
    parser.add_argument(
        "--mix-base-data",
        action="store_true",
        help="also train on the base corpora (their lengths are counted with the GPT-2 "
        "tokenizer: only for a model that shares it)",
    )
    parser.add_argument("--include-censored", action="store_true")
    parser.add_argument("--min-samples", type=int, default=50)
    parser.add_argument(
        "--max-samples", type=int, default=0, help="learn from the newest N samples only (0: all)"
    )
    parser.add_argument("--gate-fraction", type=float, default=0.2)
    jobs = parser.add_mutually_exclusive_group()
    jobs.add_argument("--job", type=int, default=None, help="run this queued retrain job")
    parser.add_argument(
        "--claimed",
        action="store_true",
        help="with --job: the job is already running, claimed by the worker that started this",
    )
    jobs.add_argument("--run-queued", action="store_true", help="run every queued job, then exit")
    jobs.add_argument(
        "--if-drifted",
        action="store_true",
        help="retrain each served model (or --model) whose rolling error the GATEWAY_DRIFT_* "
        "settings call drifted; needs GATEWAY_FEDERATION_FILE for the served models",
    )
    return parser.parse_args(argv)


def options_of(args: argparse.Namespace) -> AdaptOptions:
    return AdaptOptions(
        mode=args.mode,
        activate=args.activate,
        out=args.out,
        base=args.base,
        mix_base_data=args.mix_base_data,
        include_censored=args.include_censored,
        min_samples=args.min_samples,
        gate_fraction=args.gate_fraction,
        max_samples=args.max_samples,
    )


async def run(args: argparse.Namespace) -> int:
    if not args.database_url:
        print("error: --database-url or GATEWAY_DATABASE_URL is required", file=sys.stderr)
        return 2
    engine = create_engine(args.database_url)
    sessions = create_sessionmaker(engine)
    options = options_of(args)
    try:
        if args.job is not None or args.run_queued:
            store = RetrainJobStore(sessions)
            if args.claimed:
                return await _run_claimed_job(store, sessions, args.job, options)
            return await _run_jobs(store, sessions, args.job, options)
        if args.if_drifted:
            return await retrain_drifted(sessions, options, args.model)
        try:
            await adapt(sessions, args.model, options)
        except RunRefused as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exc.exit_code
        return 0
    finally:
        await engine.dispose()


async def _run_claimed_job(
    jobs: RetrainJobStore, sessions: Sessions, job_id: int | None, options: AdaptOptions
) -> int:
    job = await jobs.get(job_id) if job_id is not None else None
    if job is None or job.state != "running":
        print(f"error: job {job_id} is not running", file=sys.stderr)
        return 2
    return 0 if await run_claimed(jobs, sessions, job, options) else 1


async def _run_jobs(
    jobs: RetrainJobStore, sessions: Sessions, job_id: int | None, options: AdaptOptions
) -> int:
    """One job (--job: it must be queued), or queued jobs until none is left; 1 if any
    failed."""
    worst = 0
    while True:
        job = await jobs.claim(job_id)
        if job is None:
            if job_id is not None:
                print(f"error: job {job_id} is not queued", file=sys.stderr)
                return 2
            return worst
        # --job ID writes to --out itself; --run-queued, one directory per job under it.
        each = options if job_id is not None else under(options.out, options, job)
        if not await run_claimed(jobs, sessions, job, each):
            worst = 1
        if job_id is not None:
            return worst


def main(argv: list[str] | None = None) -> None:
    sys.exit(asyncio.run(run(parse_args(argv))))


if __name__ == "__main__":
    main()
