"""Retrains the length predictor from what the gateway saw, and registers the new version.

    python -m gateway.retrain_predictor --database-url URL [--out DIR] [--model NAME]
        [--activate if-better|always|never] [--no-base-data] [--min-samples 50]

It reads the collected (prompt, completion tokens) samples, trains a new version starting from
the active one (mixed with the base corpora unless --no-base-data), compares new and current on
held-out samples, and registers the new version. Gateways watching the registry switch to an
activated version without a restart (GATEWAY_PREDICTOR_POLL_S). With --model, the new version is
that model's own (it starts from the model's active version, else the default's).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.db.session import create_engine, create_sessionmaker
from gateway.predictor_lifecycle import register_artifact
from gateway.services.length_samples import count_samples, load_samples
from gateway.services.predictor_registry import DEFAULT_MODEL, PredictorRegistry

if TYPE_CHECKING:
    from predictor.retrain import RetrainReport


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.retrain_predictor", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--database-url", default=os.environ.get("GATEWAY_DATABASE_URL"))
    parser.add_argument("--out", type=Path, default=None, help="default: var/predictor/<time>")
    parser.add_argument("--base", type=Path, default=None, help="default: the active version")
    parser.add_argument(
        "--model",
        default=None,
        help="retrain this served model's own predictor, on its samples alone (default: the "
        "default predictor, on every model's samples)",
    )
    parser.add_argument("--activate", choices=("if-better", "always", "never"), default="if-better")
    parser.add_argument("--no-base-data", action="store_true")
    parser.add_argument("--include-censored", action="store_true")
    parser.add_argument("--min-samples", type=int, default=50)
    parser.add_argument("--holdout", type=float, default=0.2)
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> int:
    if not args.database_url:
        print("error: --database-url or GATEWAY_DATABASE_URL is required", file=sys.stderr)
        return 2
    engine = create_engine(args.database_url)
    sessions = create_sessionmaker(engine)
    registry = PredictorRegistry(sessions)
    try:
        key = args.model or DEFAULT_MODEL
        active = await registry.active(key) or await registry.active(DEFAULT_MODEL)
        base = args.base or (Path(active.path) if active else None)
        if base is None:
            print("error: no active predictor version to start from; pass --base", file=sys.stderr)
            return 2
        counts = await count_samples(sessions, args.model)
        samples = await load_samples(
            sessions, model=args.model, include_censored=args.include_censored
        )
        print(
            f"{counts.total} samples collected ({counts.censored} censored); using {len(samples)}",
            flush=True,
        )
        if len(samples) < args.min_samples:
            print(
                f"error: {len(samples)} samples < --min-samples {args.min_samples}", file=sys.stderr
            )
            return 1
        out = args.out or Path("var/predictor") / datetime.now(UTC).strftime(
            "retrain-%Y%m%dT%H%M%S"
        )
        report = await asyncio.to_thread(_retrain, samples, base, out, args)
        print(
            f"new {report.new_version}: MAE {report.new.mae_tokens:.1f} tokens, Spearman "
            f"{report.new.spearman:.3f} on {report.holdout_samples} held-out samples; current "
            f"{report.base_version}: MAE {report.current.mae_tokens:.1f}, Spearman "
            f"{report.current.spearman:.3f}. {report.reason}",
            flush=True,
        )
        activate = args.activate == "always" or (args.activate == "if-better" and report.better)
        await register_artifact(registry, out, model=key, activate=activate)
        print(f"registered {report.new_version} ({'active' if activate else 'not activated'})")
        return 0
    finally:
        await engine.dispose()


def _retrain(
    samples: list[tuple[str, int]], base: Path, out: Path, args: argparse.Namespace
) -> RetrainReport:
    # Imported here: training pulls in torch, which the gateway itself never loads.
    from predictor.retrain import retrain

    return retrain(
        samples, base, out, mix_base_data=not args.no_base_data, holdout_fraction=args.holdout
    )


def main(argv: list[str] | None = None) -> None:
    sys.exit(asyncio.run(run(parse_args(argv))))


if __name__ == "__main__":
    main()
