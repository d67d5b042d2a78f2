"""Runs the four fault scenarios and the soak, then writes the figures and prints the table."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import markdown_table, results_dir, write_results
from devtools.faults import scenarios
from devtools.faults.cluster import GATEWAY_ENV, Cluster
from devtools.faults.soak import soak
from devtools.postgres import postgres_database
from gateway.db.migrate import downgrade
from site_engine.make_model import make_model_dir

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO.parent / "shared" / "tokenizers" / "gpt2"
HEADER = (
    "scenario",
    "fault",
    "sent",
    "accepted",
    "completed",
    "retryable error",
    "lost",
    "p50 s",
    "p99 s",
    "what the clients saw",
)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__)
    parser.add_argument("--minutes", type=float, default=2.0, help="soak length (default 2)")
    parser.add_argument("--clients", type=int, default=6, help="soak clients (default 6)")
    parser.add_argument("--seed", type=int, default=1, help="soak fault schedule seed")
    parser.add_argument("--soak-only", action="store_true", help="skip the four scenarios")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    return parser.parse_args(argv)


def _cluster(model: Path, work: Path, url: str, names: tuple[str, ...]) -> Cluster:
    return Cluster(model, work, url, site_names=names, gateway_env=GATEWAY_ENV).start()


def _run_scenarios(model: Path, work: Path, url: str) -> list[dict[str, Any]]:
    cluster = _cluster(model, work / "scenarios", url, ("site-a", "site-b"))
    figures: list[dict[str, Any]] = []
    try:
        for scenario in (
            scenarios.kill_site_mid_stream,
            scenarios.stall_site,
            scenarios.drop_database,
            scenarios.kill_gateway_and_restart,
        ):
            figures.append(asyncio.run(scenario(cluster)))
            print(f"done: {figures[-1]['scenario']}", file=sys.stderr)
            for name, process in cluster.sites.items():  # whole again for the next one
                cluster.thaw(name)
                if not process.alive():
                    cluster.restart_site(name)
                cluster.wait_site_health(name, True, 60.0)
    finally:
        cluster.stop()
    return figures


def _row(f: dict[str, Any]) -> list[object]:
    saw = "; ".join(f"{what} ×{n}" for what, n in sorted(f["client_saw"].items()))
    return [
        f["scenario"],
        f["fault"],
        f["sent"],
        f["accepted"],
        f["completed"],
        f["retryable"],
        f["lost"],
        f["p50_s"] if f["p50_s"] is not None else "-",
        f["p99_s"] if f["p99_s"] is not None else "-",
        saw,
    ]


_IN_TABLE = {
    "scenario",
    "fault",
    "client_saw",
    "timeline",
    "sent",
    "accepted",
    "completed",
    "retryable",
    "lost",
    "p50_s",
    "p99_s",
}


def _details(figures: list[dict[str, Any]]) -> str:
    """The figures of each scenario that the table has no column for."""
    lines = []
    for f in figures:
        extra = ", ".join(f"{k} = {v}" for k, v in f.items() if k not in _IN_TABLE)
        lines.append(f"- **{f['scenario']}**: {extra}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    command = "python -m bench.faults " + " ".join(sys.argv[1:] if argv is None else argv)
    work = Path(tempfile.mkdtemp(prefix="fedllm-faults-"))
    model = make_model_dir(work / "tiny-llama", "llama", args.tokenizer)
    figures: list[dict[str, Any]] = []
    with postgres_database() as url:
        try:
            if not args.soak_only:
                figures += _run_scenarios(model, work, url)
                downgrade(url)
            cluster = _cluster(model, work / "soak", url, ("site-a", "site-b", "site-c"))
            try:
                figures.append(
                    asyncio.run(
                        soak(cluster, args.minutes * 60, clients=args.clients, seed=args.seed)
                    )
                )
            finally:
                cluster.stop()
        finally:
            downgrade(url)
    table = markdown_table(HEADER, [_row(f) for f in figures])
    markdown = (
        f"{table}\n\nLost = sent but neither completed nor answered with a retryable error "
        "(429/503, or 409 for a held Idempotency-Key, with Retry-After; a connection refused or "
        "broken before any response; an answer cut off only where the gateway was killed).\n\n"
        + _details(figures)
    )
    write_results(
        "faults",
        {"scenarios": figures, "args": vars(args) | {"tokenizer": str(args.tokenizer)}},
        markdown,
        command.strip(),
        results_dir("faults"),
    )
    print(markdown)
    if any(f["lost"] for f in figures):
        sys.exit(1)
