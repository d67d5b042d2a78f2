"""bench.gateway_overhead --rounds: the reported round is the median one, each round's ratio is
in the report."""

from __future__ import annotations

from typing import Any

from bench.gateway_overhead.__main__ import _median_round, _ratios
from bench.gateway_overhead.report import markdown


def _round(ratio: float, stream: float = 9.0) -> dict[str, Any]:
    verdict = {"rps_ratio_vs_litellm": ratio}
    return {
        "runs_dir": f"r{ratio}",
        "runs": {},
        "goals": {
            "fedllm-sqlite": {"non_stream": verdict, "stream": {"rps_ratio_vs_litellm": stream}}
        },
    }


def test_the_median_round_is_reported() -> None:
    rounds = [_round(5.8), _round(4.9), _round(5.3)]
    assert _median_round(rounds)["runs_dir"] == "r5.3"
    assert _median_round(rounds[:2])["runs_dir"] == "r4.9"  # the lower middle: no optimism
    assert _median_round([_round(6.1)])["runs_dir"] == "r6.1"
    assert _ratios(rounds[0]["goals"]) == {"fedllm-sqlite": {"non_stream": 5.8, "stream": 9.0}}


def test_the_report_lists_every_round() -> None:
    result = {
        "high_concurrency": 32, "runs": {}, "goals": {}, "date": "d", "command": "c",
        "machine": "m", "reps": 1, "predictor": "p", "routing": "r", "runs_dir": "x",
        "rounds": [{"runs_dir": "a", "ratios": {"fedllm-sqlite": {"non_stream": 4.9}}},
                   {"runs_dir": "b", "ratios": {"fedllm-sqlite": {"non_stream": 5.8}}}],
    }  # fmt: skip
    text = markdown(result)
    assert "## Rounds (2 fedllm/LiteLLM pairs in turn)" in text
    assert "| 2 | fedllm-sqlite | non-stream | 5.800 |" in text
