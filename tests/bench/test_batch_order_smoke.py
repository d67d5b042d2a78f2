"""`python -m bench.engine.batch_order --preset cpu`: a tiny random model runs one mix in every
batch order; checked for the shape and sanity of what it writes (not for the numbers, which a
two-core CPU cannot tell apart)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.engine.batch_order import main
from bench.engine.batch_order_report import ORDERS

pytestmark = pytest.mark.slow


@pytest.mark.timeout(280)
def test_every_order_runs_the_same_batch(
    tmp_path: Path, data_dir: Path, gpt2_tokenizer_dir: Path
) -> None:
    main(
        [
            "--preset", "cpu", "--mixes", "dense_35", "--items", "16",
            "--results-dir", str(tmp_path), "--name", "ci", "--model-dir", str(tmp_path / "m"),
            "--tokenizer-dir", str(gpt2_tokenizer_dir), "--data-dir", str(data_dir),
        ]
    )  # fmt: skip
    ran = json.loads((tmp_path / "ci.json").read_text())
    mix = ran["mixes"]["dense_35"]
    assert mix["facts"]["items"] == 16
    assert mix["facts"]["shared_block_share"] > 0.1  # the 35% mix shares its system prompts
    rows = mix["orders"]
    assert list(rows) == list(ORDERS)
    # Every order ran the whole batch: the same prompts, every answer to its forced length.
    assert {r["prompt_tokens"] for r in rows.values()} == {mix["facts"]["prompt_tokens"]}
    assert {r["output_tokens"] for r in rows.values()} == {mix["facts"]["answer_tokens"]}
    assert all(r["tokens_s"] > 0 for r in rows.values())
    assert rows["dfs"]["prefix_hit_tokens"] > 0
    assert set(ran["throughput_vs_best_other"]) == {"dense_35"}
    assert ran["throughput_vs_best_other"]["dense_35"] > 0
    assert ran["prefix_sharing_vs_dfs"]["dense_35"] > 0
    assert (tmp_path / "ci.md").is_file()
