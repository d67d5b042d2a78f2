"""`python -m bench.engine.lora --preset cpu`, shortened: the whole benchmark in process on a tiny
model (random PEFT adapters written by the bench, the CPU's LoRA path), two seeds, checked for
the keys it writes and for what must hold whatever the machine's load: every request of every
arm answered, the adapters' requests spread as Zipf(1) draws over the counts asked for, the
worst seed's headline values within each key's [min, max]; and the knee's interpolation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.engine.lora import main
from bench.engine.lora_driver import knee_rps

pytestmark = pytest.mark.slow


@pytest.mark.timeout(400)
def test_a_short_cpu_run_writes_the_keys(tmp_path: Path, gpt2_tokenizer_dir: Path) -> None:
    main([
        "--preset", "cpu", "--window-s", "1.5", "--drain-s", "8", "--seeds", "2",
        "--knee-window-s", "0.8", "--knee-loads", "0.5", "2.0",
        "--model-dir", str(tmp_path / "model"), "--adapter-dir", str(tmp_path / "adapters"),
        "--tokenizer-dir", str(gpt2_tokenizer_dir), "--results-dir", str(tmp_path / "out"),
    ])  # fmt: skip
    out = tmp_path / "out"
    result = json.loads((out / "engine_lora_cpu.json").read_text())
    assert result["command"].startswith("python -m bench.engine.lora --preset cpu")
    assert (out / "engine_lora_cpu.png").stat().st_size > 0
    assert "| 10_adapters |" in (out / "engine_lora_cpu.md").read_text()
    assert set(result["goodput_vs_base"]) == {"2", "4", "10"}
    for ratio in result["goodput_vs_base"].values():
        assert ratio is not None
        assert ratio > 0
    assert result["decode_step_vs_base"] > 0
    assert set(result["tpot_p50_vs_base"]) == {"2", "4", "10"}
    assert all(ratio > 0 for ratio in result["tpot_p50_vs_base"].values())
    assert result["seeds"] == [0, 1]
    assert set(result["by_seed"]) == {"0", "1"}
    low, high = result["range"]["decode_step_vs_base"]
    assert low <= high == result["decode_step_vs_base"]  # the worst (highest) seed's
    for count, (low, high) in result["range"]["goodput_vs_base"].items():
        assert low == result["goodput_vs_base"][count] <= high  # the worst (lowest) seed's
    knee = result["knee"]
    assert knee["adapters"] == 4
    for arm in ("base", "lora"):
        rungs = knee[arm]["rungs"]
        assert rungs[0]["load"] == 0.5
        assert all(r["finished"] == r["requests"] for r in rungs if "requests" in r)
    if knee["base"]["knee_rps"]:
        # The knees shown are the first seed's; the headline is the worst (lowest) seed's. Seed
        # 0's ratio was once compared with the headline, and failed when seed 1's was lower.
        first = result["by_seed"]["0"]["capacity_vs_base"]
        assert first == knee["lora"]["knee_rps"] / knee["base"]["knee_rps"]
        low, high = result["range"]["capacity_vs_base"]
        assert low == result["capacity_vs_base"] <= high
    assert "**capacity_vs_base**" in (out / "engine_lora_cpu.md").read_text()
    runs = result["runs"]
    for name, run in runs.items():
        assert run["finished"] == run["requests"] > 0, name
    # The same arrivals in every arm; Zipf(1) over 2 adapters uses both.
    assert len({run["requests"] for run in runs.values()}) == 1
    assert runs["2_adapters"]["distinct_adapters_used"] == 2
    assert 2 < runs["10_adapters"]["distinct_adapters_used"] <= 10
    merged = result["merged"]["by_adapters"]["10"]
    assert merged["gpus_merged"] == 10
    served = sorted(p.name for p in (tmp_path / "adapters").iterdir() if not p.name.startswith("."))
    assert len(served) == 10


def test_the_knee_is_where_attainment_crosses_the_line() -> None:
    # 0.96 at 2 req/s, 0.84 at 4: 0.9 is crossed half way.
    assert knee_rps([(1.0, 1.0), (2.0, 0.96), (4.0, 0.84)]) == pytest.approx((3.0, False))
    assert knee_rps([(1.0, 0.95), (2.0, 0.91)]) == (2.0, True)  # all within: a lower bound
    assert knee_rps([(1.0, 0.5)]) == (0.0, False)


@pytest.mark.timeout(300)
def test_a_unified_slots_cpu_run_answers_every_request(
    tmp_path: Path, gpt2_tokenizer_dir: Path
) -> None:
    """--lora-unified-slots (the thousand-adapter run's setting for issue 77's GPU call): slots
    out of the KV block pool, the cap (the preset's decode step needs 4 resident) and host LRU
    from the flags, every arm answered."""
    main([
        "--preset", "cpu", "--window-s", "1.0", "--drain-s", "8", "--knee-window-s", "0.5",
        "--knee-loads", "0.5", "--lora-unified-slots", "--max-loras", "4", "--max-cpu-loras", "5",
        "--model-dir", str(tmp_path / "model"), "--adapter-dir", str(tmp_path / "adapters"),
        "--tokenizer-dir", str(gpt2_tokenizer_dir), "--results-dir", str(tmp_path / "out"),
    ])  # fmt: skip
    result = json.loads((tmp_path / "out" / "engine_lora_cpu.json").read_text())
    assert result["engine"]["unified_slots"] is True
    assert (result["engine"]["max_loras"], result["engine"]["max_cpu_loras"]) == (4, 5)
    for name, run in result["runs"].items():
        assert run["finished"] == run["requests"] > 0, name
    assert result["runs"]["10_adapters"]["distinct_adapters_used"] > 4  # more than the cap
    text = (tmp_path / "out" / "engine_lora_cpu.md").read_text()
    assert "4 resident at most (unified slots)" in text
