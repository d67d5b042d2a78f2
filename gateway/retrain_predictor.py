"""Adapts a served model's length predictor to what the gateway saw, and registers the result.

    python -m gateway.retrain_predictor --database-url URL [--model NAME]
        [--mode retrain|calibrate] [--activate if-better|always|never] [--out DIR]
        [--mix-base-data] [--min-samples 50]

It reads the collected (prompt, completion tokens) samples and builds a candidate from the
active version (predictor.retrain): `calibrate` refits the map of its lengths onto the served
scale (seconds); `retrain` fine-tunes it, warm-started from its weights, then calibrates
(minutes). The gate scores the candidate on samples it never saw against the active version,
the served-mean constant and TF-IDF; with `--activate if-better` it is activated only if its MAE
of expected tokens beats all three. The decision and its numbers are stored with the version in
the registry. Gateways switch to an activated version without a restart
(GATEWAY_PREDICTOR_POLL_S). With --model, the version is that model's own (it starts from the
model's active version, else the default's) and learns from that model's samples alone.
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
    parser.add_argument("--mode", choices=("retrain", "calibrate"), default="retrain")
    parser.add_argument(
        "--mix-base-data",
        action="store_true",
        help="also train on the base corpora (their lengths are counted with the GPT-2 "
        "tokenizer: only for a model that shares it)",
    )
    parser.add_argument("--include-censored", action="store_true")
    parser.add_argument("--min-samples", type=int, default=50)
    parser.add_argument("--gate-fraction", type=float, default=0.2)
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
        for name, scores in [("candidate", report.new), *report.decision.rivals.items()]:
            print(
                f"  {name:<12} MAE {scores.mae_tokens:7.1f}  Spearman {scores.spearman:6.3f}  "
                f"p90 coverage {scores.p90_coverage:.2f}  ({scores.samples} gate samples)"
            )
        print(f"{report.new_version}: {report.reason}", flush=True)
        activate = args.activate == "always" or (args.activate == "if-better" and report.better)
        decision = report.decision.to_json() | {"mode": report.mode, "activated_by": args.activate}
        await register_artifact(registry, out, model=key, activate=activate, decision=decision)
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
        samples,
        base,
        out,
        mode=args.mode,
        mix_base_data=args.mix_base_data,
        gate_fraction=args.gate_fraction,
    )


def main(argv: list[str] | None = None) -> None:
    sys.exit(asyncio.run(run(parse_args(argv))))


if __name__ == "__main__":
    main()
