"""`python -m bench.engine.serving --phases cache`: prefix caching on and off in turn at one rate
(bench.engine.serving_cache), its pieces and one tiny run on the CPU. The ratios of a CPU run
are no measurement (a tiny model on two shared cores); the GPU command is in docs/engine.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.engine import serving
from bench.engine.serving_cache import ratios, with_repeats
from fedsim.engine_trace import WorkloadRequest


def _request(i: int, prompt: tuple[int, ...]) -> WorkloadRequest:
    return WorkloadRequest(f"r{i}", "alpaca", i, prompt, 5 + i, 5 + i, False)


def test_with_repeats_draws_a_share_of_prompts_from_a_small_pool_and_keeps_answers() -> None:
    requests = [_request(i, (i, i + 1, i + 2)) for i in range(400)]
    mixed = with_repeats(requests, 0.5, 4, seed=3)
    pool = {r.prompt_token_ids for r in requests[:4]}
    pooled = [r for r in mixed if r.corpus.endswith("+pool")]
    assert 150 < len(pooled) < 250
    assert all(r.prompt_token_ids in pool for r in pooled)
    assert [r.output_tokens for r in mixed] == [r.output_tokens for r in requests]
    assert [r.request_id for r in mixed] == [r.request_id for r in requests]
    assert with_repeats(requests, 0.5, 4, seed=3) == mixed  # deterministic per seed
    assert with_repeats(requests, 0.0, 4, seed=3) == requests


def test_ratios_take_the_worst_pair() -> None:
    runs = {
        "on": [{"output_tok_s": 90.0, "tpot_p50_ms": 11.0}, {"output_tok_s": 100.0,
                                                              "tpot_p50_ms": 10.0}],
        "off": [{"output_tok_s": 100.0, "tpot_p50_ms": 10.0}, {"output_tok_s": 100.0,
                                                               "tpot_p50_ms": 10.0}],
    }  # fmt: skip
    keys = ratios(runs)
    assert keys["prefix_cache_goodput_ratio"] == pytest.approx(0.9)
    assert keys["prefix_cache_tpot_p50_ratio"] == pytest.approx(1.1)
    assert ratios({"on": [], "off": []})["prefix_cache_goodput_ratio"] is None


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cache_phase_on_cpu_alternates_arms_and_writes_the_ratios(
    tmp_path: Path, gpt2_tokenizer_dir: Path, data_dir: Path
) -> None:
    serving.main(
        [
            "--small", "--device", "cpu", "--dtype", "float32", "--phases", "cache",
            "--rates", "4", "--duration-s", "2", "--prefix-cache-repeat", "2",
            "--prefix-cache-repeat-fraction", "0.9", "--prefix-cache-pool", "2",
            "--model-dir", str(tmp_path / "model"),
            "--tokenizer-dir", str(gpt2_tokenizer_dir), "--data-dir", str(data_dir),
            "--results-dir", str(tmp_path / "results"), "--name", "cache_smoke",
        ]
    )  # fmt: skip
    written = json.loads((tmp_path / "results" / "cache_smoke.json").read_text())
    assert written["complete"]
    assert written["errors"] == {}
    runs = written["prefix_cache"]["runs"]
    assert [len(runs["on"]), len(runs["off"])] == [2, 2]
    for arm in ("on", "off"):
        assert all(r["completed"] == r["requests"] > 0 for r in runs[arm])
    # Repeated prompts hit with the cache on; with it off there is nothing to hit.
    assert all(r["prefix_cache_hit_fraction"] > 0 for r in runs["on"])
    assert all(r["prefix_cache_hit_fraction"] is None for r in runs["off"])
    # The two runs of a pair serve the same requests.
    assert [r["requests"] for r in runs["on"]] == [r["requests"] for r in runs["off"]]
    assert written["prefix_cache_goodput_ratio"] > 0
    assert written["prefix_cache_tpot_p50_ratio"] > 0
    assert "Prefix cache on vs off" in (tmp_path / "results" / "cache_smoke.md").read_text()
