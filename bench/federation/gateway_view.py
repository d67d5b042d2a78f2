"""The sweep as the gateways recorded it: every request's row, whatever the client saw.

The load generator cuts off what is still streaming `drain_s` after the last arrival. Its
headline rule used to count such a request as missing the SLO even when its first token came at
once and it was streaming at full speed (a 1,024-token answer sent near the end of the arrivals
outlasts a 12 s drain); it now judges it on its TTFT and its TPOT until the cut, from the
client's side (bench/federation/metrics.py). This view gives the same judgement from the
gateway's side, over the tokens the gateway counted rather than the events the client got. It
reads each arm's own request log: a request with a first token
counts with its real TTFT, and its TPOT over the tokens it had produced when it ended or was
cut off; a request with no first token counts as missing both. The gateway's times include the
wide-area hop to the sites (the latency injector sits between gateway and sites); the client is
on loopback. Runs of one arm are told apart by the gap between them (arrivals are continuous
within a run).

    python -m bench.federation.gateway_view --work-dir /tmp/fed --name NAME --rates R...
    python -m bench.federation.gateway_view \
        --requests bench/results/federation/NAME_requests.json.gz --rates R...

The first form also writes NAME_requests.json.gz (the rows it read), so the summary can be
made again from the repository.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sqlite3
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import markdown_table, results_dir
from bench.federation.metrics import TPOT_SLO_S, TTFT_SLO_S, percentile
from bench.federation.report import BASELINE

_RUN_GAP_S = 5.0
_QUERY = (
    "SELECT created_at, first_token_at, finished_at, completion_tokens, status, site_id "
    "FROM requests ORDER BY created_at"
)


@dataclass(frozen=True, slots=True)
class RequestRow:
    created_s: float
    first_token_s: float | None
    finished_s: float | None
    completion_tokens: int
    status: str

    @property
    def ttft_s(self) -> float:
        return math.inf if self.first_token_s is None else self.first_token_s - self.created_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_token_s is None or self.finished_s is None or self.completion_tokens < 2:
            return None
        return (self.finished_s - self.first_token_s) / (self.completion_tokens - 1)


def _epoch(value: str | None) -> float | None:
    return None if value is None else datetime.fromisoformat(value).timestamp()


def read_work_dir(work_dir: Path) -> dict[str, list[RequestRow]]:
    """Each arm's request rows, from `work_dir/gateways/<arm>/gateway.db`."""
    rows: dict[str, list[RequestRow]] = {}
    for database in sorted(work_dir.glob("gateways/*/gateway.db")):
        with sqlite3.connect(database) as connection:
            found = connection.execute(_QUERY).fetchall()
        rows[database.parent.name] = [
            RequestRow(
                float(_epoch(created) or 0.0), _epoch(first), _epoch(done), int(n or 0), status
            )
            for created, first, done, n, status, _site in found
        ]
    if not rows:
        raise SystemExit(f"no gateways/*/gateway.db under {work_dir}")
    return rows


def split_runs(rows: Sequence[RequestRow], gap_s: float = _RUN_GAP_S) -> list[list[RequestRow]]:
    runs: list[list[RequestRow]] = []
    for row in rows:
        if runs and row.created_s - runs[-1][-1].created_s <= gap_s:
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs


def summarize_run(run: Sequence[RequestRow]) -> dict[str, Any]:
    ttft = [row.ttft_s for row in run]
    tpot = [t for t in (row.tpot_s for row in run) if t is not None]
    ttft_p99, tpot_p99 = percentile(ttft, 0.99), percentile(tpot, 0.99)
    span = max(run[-1].created_s - run[0].created_s, 1e-9)
    return {
        "requests": len(run),
        "completed": sum(1 for row in run if row.status == "completed"),
        "cut_off_or_failed": sum(1 for row in run if row.status != "completed"),
        "without_first_token": sum(1 for row in run if row.first_token_s is None),
        "arrival_rps": round((len(run) - 1) / span, 2),
        "ttft_p99_s": round(ttft_p99, 3) if math.isfinite(ttft_p99) else None,
        "tpot_p99_ms": round(tpot_p99 * 1000, 1) if math.isfinite(tpot_p99) else None,
        "holds_slo": ttft_p99 <= TTFT_SLO_S and tpot_p99 <= TPOT_SLO_S,
    }


def summarize(rows: Mapping[str, Sequence[RequestRow]], rates: Sequence[float]) -> dict[str, Any]:
    """Per arm, one summary per run, matched in order to the sweep's `rates`."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for arm, arm_rows in rows.items():
        split = split_runs(arm_rows)
        if len(split) != len(rates):
            raise SystemExit(f"{arm}: {len(split)} runs in its log, {len(rates)} rates given")
        runs[arm] = [
            {"rate_rps": rate, **summarize_run(run)} for rate, run in zip(rates, split, strict=True)
        ]
    goodput = {arm: _goodput(arm_runs) for arm, arm_runs in runs.items()}
    base = goodput.get(BASELINE, 0.0)
    return {
        "slo": {"ttft_p99_s": TTFT_SLO_S, "tpot_p99_s": TPOT_SLO_S, "network": "included"},
        "goodput_rps": goodput,
        "goodput_vs_least_requests": {
            arm: round(value / base, 3) if base else None for arm, value in goodput.items()
        },
        "runs": runs,
    }


def _goodput(runs: Sequence[Mapping[str, Any]]) -> float:
    best = 0.0
    for run in sorted(runs, key=lambda r: float(r["rate_rps"])):
        if not run["holds_slo"]:
            break
        best = float(run["rate_rps"])
    return best


def dump_rows(rows: Mapping[str, Sequence[RequestRow]], path: Path) -> None:
    payload = {
        arm: [
            [r.created_s, r.first_token_s, r.finished_s, r.completion_tokens, r.status]
            for r in arm_rows
        ]
        for arm, arm_rows in rows.items()
    }
    with gzip.open(path, "wt") as out:
        json.dump(payload, out)


def load_rows(path: Path) -> dict[str, list[RequestRow]]:
    with gzip.open(path, "rt") as stored:
        payload = json.load(stored)
    return {arm: [RequestRow(*row) for row in arm_rows] for arm, arm_rows in payload.items()}


def markdown(name: str, view: Mapping[str, Any], command: str) -> str:
    header = ["arm", "rate rps", "requests", "cut off / failed", "no first token"]
    header += ["TTFT p99 s", "TPOT p99 ms", "holds SLO"]
    rows = [
        [
            arm, run["rate_rps"], run["requests"], run["cut_off_or_failed"],
            run["without_first_token"], run["ttft_p99_s"] if run["ttft_p99_s"] is not None
            else "-", run["tpot_p99_ms"] if run["tpot_p99_ms"] is not None else "-",
            "yes" if run["holds_slo"] else "no",
        ]
        for arm, arm_runs in view["runs"].items()
        for run in arm_runs
    ]  # fmt: skip
    goodput = [
        [arm, view["goodput_rps"][arm], view["goodput_vs_least_requests"][arm]]
        for arm in view["runs"]
    ]
    return "\n".join(
        [
            f"# {name}: the sweep as the gateways recorded it",
            "",
            f"Command: `{command}`",
            "",
            "A request cut off at the end of the drain counts with its real TTFT and its TPOT so"
            " far; one with no first token misses both (bench/federation/gateway_view.py).",
            "",
            markdown_table(header, rows),
            "",
            f"Goodput (TTFT p99 <= {TTFT_SLO_S:g} s, TPOT p99 <= {TPOT_SLO_S * 1000:g} ms):",
            "",
            markdown_table(["arm", "goodput rps", "vs least_requests"], goodput),
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.federation.gateway_view")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--work-dir", type=Path, help="a run's --work-dir (gateways/*/gateway.db)")
    source.add_argument("--requests", type=Path, help="a stored NAME_requests.json.gz")
    parser.add_argument("--rates", type=float, nargs="+", required=True, help="the sweep's rates")
    parser.add_argument("--name", default=None, help="result name (default: from --requests)")
    parser.add_argument("--out-dir", type=Path, default=results_dir("federation"))
    args = parser.parse_args(argv)
    if args.work_dir is not None:
        rows = read_work_dir(args.work_dir)
        name = args.name or "federation"
        dump_rows(rows, args.out_dir / f"{name}_requests.json.gz")
    else:
        rows = load_rows(args.requests)
        name = args.name or args.requests.name.removesuffix("_requests.json.gz")
    view = summarize(rows, args.rates)
    given = sys.argv[1:] if argv is None else list(argv)
    command = "python -m bench.federation.gateway_view " + " ".join(given)
    (args.out_dir / f"{name}_gateway_view.json").write_text(json.dumps(view, indent=2) + "\n")
    (args.out_dir / f"{name}_gateway_view.md").write_text(markdown(name, view, command))
    print(markdown(name, view, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
