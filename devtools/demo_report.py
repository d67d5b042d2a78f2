"""What the demo prints: a few real answers, every answer's predicted and actual length, per-site
totals, and the predictor's error on the requests it just served (predicted vs actual answer
tokens, over those answers alone: the dashboard's figures cover other sets, each says which);
with --keep-running, a curl command ready to paste against the gateway it left running.

The README shows the same command with PORT for the port (tests/unit/devtools/test_demo_report.py
checks they are one), so the README's example is the command the demo prints.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gateway.stores.stats import PredictionPair, SiteTotals
from predictor.evaluate import spearman


@dataclass(frozen=True, slots=True)
class DemoAnswer:
    ok: bool
    site: str
    stream: bool
    latency_s: float
    prompt: str
    answer: str = ""
    finish_reason: str = ""
    completion_tokens: int = 0
    detail: str = ""
    request_id: str = ""
    # What the gateway predicted for it (its request row), when it predicted.
    predicted_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class PredictionError:
    requests: int
    mae_tokens: float
    mean_mae_tokens: float  # what predicting the served mean would have scored
    spearman: float
    mean_predicted: float
    mean_actual: float


# The question of the README's examples: short, so that the answer comes in a second or two.
TRY_IT_QUESTION = "Name three clouds."
TRY_IT_MAX_TOKENS = 64


def try_it_command(base_url: str, model: str) -> str:
    """A chat completion with curl against `base_url`, as a shell reads it when pasted."""
    head = f'{{"model": {json.dumps(model)}, "max_tokens": {TRY_IT_MAX_TOKENS},'
    turn = json.dumps({"role": "user", "content": TRY_IT_QUESTION})
    return (
        f"curl -s {base_url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"  -d '{head}\n"
        f'       "messages": [{turn}]}}\''
    )


def print_keep_running(base_url: str, model: str, work_dir: str, admin_token: str) -> None:
    """What --keep-running leaves up, and what to do with it."""
    print(f"\nservices keep running: {base_url} (logs in {work_dir}); Ctrl-C (or SIGTERM) stops")
    print("try it (paste into another terminal; on loopback no API key is needed):\n")
    print(try_it_command(base_url, model))
    print(f"\ndashboard: {base_url}/admin  sign in with the admin token: {admin_token}", flush=True)


def _one_line(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def print_answers(answers: Sequence[DemoAnswer], count: int, width: int = 100) -> None:
    shown = [a for a in answers if a.ok][:count]
    for answer in shown:
        print(f"> {_one_line(answer.prompt, width - 2)}")
        predicted = "-" if answer.predicted_tokens is None else answer.predicted_tokens
        print(
            f"  [{answer.site}: {answer.completion_tokens} tokens (predicted {predicted}), "
            f"{answer.finish_reason}]"
        )
        print(f"  {_one_line(answer.answer, 2 * width)}")
    if shown:
        print()


def print_predictions(answers: Sequence[DemoAnswer], width: int = 48) -> None:
    """One line per answer: the length predicted before it was routed, and the real one."""
    rows = [
        (
            str(n),
            a.site,
            "-" if a.predicted_tokens is None else str(a.predicted_tokens),
            str(a.completion_tokens),
            "-" if a.predicted_tokens is None else str(a.predicted_tokens - a.completion_tokens),
            a.finish_reason,
            _one_line(a.prompt, width),
        )
        for n, a in enumerate(answers, 1)
        if a.ok
    ]
    _table(
        ("#", "site", "predicted", "actual", "error", "finish", "prompt"),
        rows,
        numeric=(0, 2, 3, 4),
    )
    print()


def _table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    numeric: Sequence[int],
    ruled: Sequence[int] = (),
) -> None:
    """Aligned columns, a rule under the header and above the rows numbered in `ruled`."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for index, row in enumerate((header, *rows)):
        if index == 1 or index - 1 in ruled:
            print("-+-".join("-" * w for w in widths))
        cells = (
            cell.rjust(w) if i in numeric else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        print(" | ".join(cells).rstrip())


def prediction_error(pairs: Sequence[PredictionPair]) -> PredictionError | None:
    if not pairs:
        return None
    predicted = np.array([p.predicted_tokens for p in pairs], dtype=np.float64)
    actual = np.array([p.completion_tokens for p in pairs], dtype=np.float64)
    return PredictionError(
        requests=len(pairs),
        mae_tokens=float(np.abs(predicted - actual).mean()),
        mean_mae_tokens=float(np.abs(actual.mean() - actual).mean()),
        spearman=spearman(predicted, actual),
        mean_predicted=float(predicted.mean()),
        mean_actual=float(actual.mean()),
    )


def print_prediction_error(error: PredictionError | None, predictor: str) -> None:
    if error is None:
        print("predictor: no request carried a prediction (fallback mode)")
        return
    print(
        f"predictor {predictor} on the {error.requests} answers just served: "
        f"MAE {error.mae_tokens:.1f} tokens (predicting their mean: {error.mean_mae_tokens:.1f}), "
        f"Spearman {error.spearman:.2f}, mean predicted {error.mean_predicted:.0f} "
        f"vs actual {error.mean_actual:.0f}"
    )


def print_site_table(
    totals: Sequence[SiteTotals],
    errors: dict[str, PredictionError],
    overall: PredictionError | None = None,
) -> None:
    header = (
        "site",
        "cloud",
        "region",
        "requests",
        "failed",
        "prompt tok",
        "answer tok",
        "predicted tok",
        "pred. MAE",
    )
    rows = [
        (
            t.site,
            t.cloud,
            t.region,
            str(t.requests),
            str(t.failed),
            str(t.prompt_tokens),
            str(t.completion_tokens),
            str(t.predicted_tokens),
            f"{errors[t.site].mae_tokens:.1f}" if t.site in errors else "-",
        )
        for t in totals
    ]
    mae = f"{overall.mae_tokens:.1f}" if overall is not None else "-"
    total = ("total", "", "", *(str(sum(int(r[i]) for r in rows)) for i in range(3, 8)), mae)
    _table(header, [*rows, total], numeric=range(3, len(header)), ruled=(len(rows),))
