"""bench/gateway_overhead/side_by_side.py: variant specs and the paired summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.gateway_overhead.side_by_side import Variant, parse_variant, summarize


@pytest.mark.parametrize(
    ("spec", "env"),
    [
        ("base=/tmp/a", {}),
        ("base=/tmp/a:GATEWAY_REQUEST_LOG_FLUSH_MS=100", {"GATEWAY_REQUEST_LOG_FLUSH_MS": "100"}),
        ("base=/tmp/a:A=1,DB=postgresql+psycopg://u@h/d", {"A": "1", "DB": "postgresql+psycopg://u@h/d"}),
    ],
)  # fmt: skip
def test_a_variant_is_a_checkout_with_its_environment(spec: str, env: dict[str, str]) -> None:
    variant = parse_variant(spec, 8101)
    assert (variant.name, variant.checkout, variant.env, variant.port) == (
        "base",
        Path("/tmp/a"),
        env,
        8101,
    )


@pytest.mark.parametrize("spec", ["base", "=/tmp/a", "base=", "base=/tmp/a:FLAG"])
def test_malformed_variants_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match=r"NAME=CHECKOUT|KEY=VALUE"):
        parse_variant(spec, 8101)


def test_each_round_is_compared_with_the_first_variants_run_of_that_round() -> None:
    variants = [Variant("a", Path("/a"), {}, 1), Variant("b", Path("/b"), {}, 2)]

    def run(p50: float) -> dict[str, float]:
        return {
            "rps": 1000 / p50,
            "p50_ms": p50,
            "p90_ms": p50 + 1,
            "cpu_ms_per_request": p50 - 0.5,
            "failed": 0,
        }

    # The host slows down over the rounds; b is 0.2 ms faster in every round but one.
    runs = {
        "a": [run(3.0), run(4.0), run(5.0)],
        "b": [run(2.8), run(3.8), run(5.1)],
    }
    a, b = summarize(variants, runs)
    assert (a["paired_p50_diff_ms"], a["rounds_lower"]) == (0.0, 0)
    assert b["paired_p50_diff_ms"] == pytest.approx(-0.2)
    assert b["rounds_lower"] == 2
    assert b["p50_ms"] == 3.8
    assert b["cpu_ms_per_request"] == 3.3
    assert b["rps"] == pytest.approx(1000 / 3.8)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--rounds", "3"], "python -m bench.x --rounds 3"),
        ([], "python -m bench.x "),
    ],
)
def test_the_results_name_the_command_that_made_them(argv: list[str], expected: str) -> None:
    from bench.common import command_line

    assert command_line("bench.x", argv) == expected
