"""What the demo prints (issue 32, a newcomer's first hour): each answer's predicted and actual
length side by side, and the prediction error of all the answers in the sites table's total row
(it was blank)."""

from __future__ import annotations

import json
import shlex

import pytest

from devtools.demo_report import (
    DemoAnswer,
    prediction_error,
    print_answers,
    print_keep_running,
    print_predictions,
    print_site_table,
    try_it_command,
)
from gateway.stores.stats import PredictionPair, SiteTotals

ANSWERS = [
    DemoAnswer(True, "aws", False, 1.0, "Capital of France?", "Paris", "stop", 12, "",
               "chatcmpl-1", predicted_tokens=20),
    DemoAnswer(True, "gcp", True, 1.0, "Hi", "Hello", "length", 256, "", "chatcmpl-2",
               predicted_tokens=200),
    DemoAnswer(False, "-", False, 1.0, "Lost", detail="HTTP 503"),
]  # fmt: skip
PAIRS = [PredictionPair("aws", 20, 12, "chatcmpl-1"), PredictionPair("gcp", 200, 256, "chatcmpl-2")]


def test_every_answer_shows_its_predicted_and_actual_length(
    capsys: pytest.CaptureFixture[str],
) -> None:
    print_answers(ANSWERS, 1)
    print_predictions(ANSWERS)
    out = capsys.readouterr().out
    assert "[aws: 12 tokens (predicted 20), stop]" in out
    rows = [
        [cell.strip() for cell in line.split(" | ")]
        for line in out.splitlines()
        if line[:1].isdigit()
    ]
    assert [row[1:5] for row in rows] == [["aws", "20", "12", "8"], ["gcp", "200", "256", "-56"]]


def test_the_total_row_carries_the_error_over_every_answer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    totals = [SiteTotals("aws", "aws", "us-east-1", 1, 1, 0, 10, 12, 20),
              SiteTotals("gcp", "gcp", "europe-west4", 1, 1, 0, 5, 256, 200)]  # fmt: skip
    per_site = {pair.site: prediction_error([pair]) for pair in PAIRS}
    print_site_table(totals, {k: v for k, v in per_site.items() if v}, prediction_error(PAIRS))
    total = capsys.readouterr().out.splitlines()[-1].split(" | ")
    assert total[0].strip() == "total"
    assert total[-1].strip() == "32.0"  # (8 + 56) / 2


def test_keep_running_prints_a_curl_command_with_the_real_port(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`make demo DEMO_ARGS=--keep-running` ends with a command that works when pasted: its
    gateway's own port, a body the chat API takes, quoted as a shell reads it."""
    print_keep_running("http://127.0.0.1:41234", "SmolLM2-135M-Instruct", "/tmp/demo", "tok")
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("curl "))
    command = "\n".join(lines[start : start + 3])
    assert command == try_it_command("http://127.0.0.1:41234", "SmolLM2-135M-Instruct")
    argv = shlex.split(command)  # the backslash-newline joins the lines, as in a shell
    assert argv[:3] == ["curl", "-s", "http://127.0.0.1:41234/v1/chat/completions"]
    body = json.loads(argv[argv.index("-d") + 1])
    assert body == {
        "model": "SmolLM2-135M-Instruct",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Name three clouds."}],
    }
    assert argv[argv.index("-H") + 1] == "Content-Type: application/json"
    assert "dashboard: http://127.0.0.1:41234/admin" in out
    assert "admin token: tok" in out
