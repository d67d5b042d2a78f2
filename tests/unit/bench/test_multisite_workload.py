"""The benchmark's workload: true lengths replayed, records that do not fit skipped, skewed
arrival order."""

from __future__ import annotations

import pytest

from bench.multisite.options import grid_cells, parse_options
from bench.multisite.workload import Query, Workload, draw_queries, skewed
from predictor.datasets import PromptRecord


def words(text: str) -> list[int]:
    """One token per word: lengths are easy to read in the tests."""
    return [len(word) for word in text.split()]


def record(index: int, prompt_words: int, answer_words: int) -> PromptRecord:
    return PromptRecord("alpaca_random", index, "p " * prompt_words, "a " * answer_words)


def test_queries_replay_the_true_answer_length_and_skip_what_does_not_fit() -> None:
    records = [record(0, 3, 5), record(1, 2, 50), record(2, 4, 1), record(3, 0, 2)]
    workload = draw_queries(records, 2, words, max_total_tokens=20, seed=0)
    assert sorted((q.prompt_tokens, q.answer_tokens) for q in workload.queries) == [(3, 5), (4, 1)]
    # Records drawn before the second usable one and left out: the too long and the empty one.
    assert 0 <= workload.skipped_too_long <= 2
    assert all(q.id.startswith("alpaca_random-") for q in workload.queries)


def test_the_answer_cap_cuts_lengths_and_is_reported() -> None:
    workload = draw_queries(
        [record(0, 2, 40)], 1, words, max_total_tokens=100, seed=0, answer_cap=8
    )
    assert workload.queries[0].answer_tokens == 8
    assert workload.describe()["answer_cap"] == 8


def test_too_few_usable_records_is_an_error() -> None:
    with pytest.raises(ValueError, match="only 1 usable"):
        draw_queries([record(0, 2, 2), record(1, 2, 99)], 2, words, max_total_tokens=10, seed=0)


def test_the_draw_is_seeded() -> None:
    records = [record(i, 2, i % 7 + 1) for i in range(30)]
    first = draw_queries(records, 10, words, max_total_tokens=50, seed=3)
    again = draw_queries(records, 10, words, max_total_tokens=50, seed=3)
    other = draw_queries(records, 10, words, max_total_tokens=50, seed=4)
    assert first == again
    assert first.queries != other.queries


def test_skewed_order_keeps_the_queries_and_sends_the_long_ones_in_bursts() -> None:
    queries = tuple(Query(f"q{i}", "p", 2, 10 if i % 10 == 0 else 1) for i in range(100))
    order = skewed(Workload(queries, 0, None), long_share=0.1, burst=5, seed=1).queries
    assert sorted(q.id for q in order) == sorted(q.id for q in queries)
    long_at = [i for i, q in enumerate(order) if q.answer_tokens == 10]
    runs = [long_at[i + 1] - long_at[i] for i in range(len(long_at) - 1)]
    assert runs.count(1) == 8  # two bursts of five back-to-back long answers


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ("full", ((2, (2, 3)), (6, (2, 3)))),
        ("cross", ((2, (3,)), (6, (2, 3)))),
    ],
)
def test_grid_shapes(shape: str, expected: tuple[tuple[int, tuple[int, ...]], ...]) -> None:
    assert grid_cells((2, 3), (2, 6), shape, (3, 6)) == expected


def test_the_default_grid_sweeps_sites_at_batch_6_and_batches_at_3_sites() -> None:
    options = parse_options(["--no-predictor"])
    assert options.grid == ((2, (3,)), (6, (2, 3, 6, 9)), (10, (3,)))
    assert options.predictor_dir is None


def test_an_ablation_cell_outside_the_grid_is_refused() -> None:
    with pytest.raises(ValueError, match="ablation cell"):
        parse_options(["--sites", "2", "--max-batch", "4", "--ablation", "3", "4"])
