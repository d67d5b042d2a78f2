"""What the demo prints: a few real answers, per-site totals, and the predictor's error on the
requests it just served (predicted vs actual answer tokens)."""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class PredictionError:
    requests: int
    mae_tokens: float
    mean_mae_tokens: float  # what predicting the served mean would have scored
    spearman: float
    mean_predicted: float
    mean_actual: float


def _one_line(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def print_answers(answers: Sequence[DemoAnswer], count: int, width: int = 100) -> None:
    shown = [a for a in answers if a.ok][:count]
    for answer in shown:
        print(f"> {_one_line(answer.prompt, width - 2)}")
        print(f"  [{answer.site}: {answer.completion_tokens} tokens, {answer.finish_reason}]")
        print(f"  {_one_line(answer.answer, 2 * width)}")
    if shown:
        print()


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


def print_site_table(totals: Sequence[SiteTotals], errors: dict[str, PredictionError]) -> None:
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
    total = ("total", "", "", *(str(sum(int(r[i]) for r in rows)) for i in range(3, 8)), "")
    all_rows = [*rows, total]
    widths = [max(len(row[i]) for row in (header, *all_rows)) for i in range(len(header))]
    line = "-+-".join("-" * w for w in widths)
    for index, row in enumerate((header, *all_rows)):
        if index in (1, len(all_rows)):
            print(line)
        print(
            " | ".join(
                cell.ljust(w) if i < 3 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
