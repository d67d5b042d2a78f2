"""`python -m bench.engine.lora --preset cpu`, shortened: the whole benchmark in process on a tiny
model (random PEFT adapters written by the bench, the CPU's LoRA path), checked for the keys
it writes and for what must hold whatever the machine's load: every request of every arm
answered, the adapters' requests spread as Zipf(1) draws over the counts asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.engine.lora import main

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
def test_a_short_cpu_run_writes_the_keys(tmp_path: Path, gpt2_tokenizer_dir: Path) -> None:
    main([
        "--preset", "cpu", "--window-s", "1.5", "--drain-s", "8",
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
