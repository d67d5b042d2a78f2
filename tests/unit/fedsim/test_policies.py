"""fedsim.policies: the engine's batch policies on one simulated site hold the properties
iteration-level scheduling and shortest-first guarantee, on the real scheduler."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedsim.cards import CARDS, MODELS
from fedsim.policies import compare, main, markdown, run_policy
from fedsim.site import SiteSpec
from fedsim.step_models import STEP_MODELS, step_model


def test_iteration_level_never_needs_more_steps_or_kv_than_static() -> None:
    result = compare("h100", "llama1b", 16, 3, STEP_MODELS, batch_sizes=(2, 4))
    for row in result.batching:
        assert (row.iteration.policy, row.static.policy) == ("fcfs", "static")
        assert row.iteration.steps <= row.static.steps
        assert row.iteration.cumulative_kv_tokens <= row.static.cumulative_kv_tokens
        assert row.iteration.seconds <= row.static.seconds
    # Static batching waits for each batch's longest answer.
    assert max(row.iterations_ratio for row in result.batching) > 1.2
    assert 0 < result.kv_cumulative_reduction < 1
    fcfs, oracle = result.ordering[0], result.ordering[1]
    assert (fcfs.policy, oracle.policy) == ("fcfs", "spf_oracle")
    # Shortest-first with exact predictions must not lose to arrival order on mean completion.
    assert oracle.mean_completion_steps <= fcfs.mean_completion_steps
    assert "| 2 |" in markdown(result)


def test_every_answer_runs_to_its_length() -> None:
    spec = SiteSpec(
        "s", CARDS["h100"], MODELS["llama1b"], step_model("h100", "llama1b"), 0.0,
        max_num_seqs=1, prefix_caching=False,
    )  # fmt: skip
    run = run_policy(spec, [(10, 5), (3, 7)])
    # One sequence at a time: one prefill step and then a decode step per further token, each.
    assert run.steps == (1 + 4) + (1 + 6)
    assert run.mean_completion_steps == (5 + 12) / 2


def test_refuses_an_empty_burst(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--requests", "0", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())
