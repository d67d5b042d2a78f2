"""Adapters that cannot harm other tenants (issue 59), checked when they load: weights with NaN,
infinite values or values past the serving dtype's range are refused; PEFT features the engine
does not serve as peft does are refused by name; a config without `lora_alpha` takes peft's
default; no message shows the site's paths. The engine's answers for the other rows of the same
steps are PeftModel's, token for token (a tiny random Llama, float32)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from site_engine.__main__ import lora_settings
from site_engine.engine.core.api import AdapterRefused, EngineRequest
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.lora.adapter import (
    CONFIG_FILE,
    PEFT_DEFAULT_ALPHA,
    WEIGHTS_FILE,
    AdapterError,
    BaseShapes,
    read_adapter,
)
from site_engine.engine.lora.registry import AdapterRegistry, LoraSettings
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.metrics import EngineStatsCollector
from site_engine.model_loading import LoadedModel, load_model
from site_engine.settings import SettingsError, SiteSettings
from tests.unit.engine.test_lora_adapters import drain, write_adapter
from tests.unit.test_site_metrics import FixedStats, parse, scalar

MAX_TOKENS = 6
KEY = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(tiny_llama_dir)


def _poke(path: Path, value: float) -> Path:
    """`path`'s adapter with one weight of layer 1's v_proj B set to `value`."""
    tensors = load_file(str(path / WEIGHTS_FILE))
    tensors[KEY][3, 1] = value
    save_file(tensors, str(path / WEIGHTS_FILE))
    return path


@pytest.mark.parametrize(
    ("value", "dtype", "message"),
    [
        (float("nan"), torch.float32, "layer 1 v_proj lora_B holds NaN or infinite values"),
        (float("inf"), torch.bfloat16, "layer 1 v_proj lora_B holds NaN or infinite values"),
        (70000.0, torch.float16, r"values up to 70000, past the serving dtype's range "
                                 r"\(float16: at most 65504\)"),
    ],
)  # fmt: skip
def test_weights_a_step_cannot_use_are_refused_without_paths(
    tmp_path: Path, loaded: LoadedModel, value: float, dtype: torch.dtype, message: str
) -> None:
    base = BaseShapes.of_model(loaded.model)
    path = _poke(write_adapter(tmp_path / "bad", base, targets=("q_proj", "v_proj")), value)
    with pytest.raises(AdapterError, match=message) as refused:
        read_adapter(path, "bad", base, 16, dtype)
    assert str(tmp_path) not in str(refused.value)
    # 70,000 is a fine value where the serving dtype holds it.
    if value == 70000.0:
        assert read_adapter(path, "bad", base, 16, torch.bfloat16).rank == 4


@pytest.mark.parametrize(
    ("option", "feature"),
    [
        ({"alora_invocation_tokens": [5, 6]}, "aLoRA"),
        ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication"),
        ({"trainable_token_indices": [3, 4]}, "trainable tokens"),
        ({"use_qalora": True}, "QALoRA"),
        ({"arrow_config": {"top_k": 2}}, "Arrow routing"),
    ],
)
def test_peft_features_served_otherwise_are_refused_by_name(
    tmp_path: Path, loaded: LoadedModel, option: dict[str, Any], feature: str
) -> None:
    base = BaseShapes.of_model(loaded.model)
    path = write_adapter(tmp_path / "x", base, **option)
    with pytest.raises(AdapterError, match=f"{feature}.* is not supported"):
        read_adapter(path, "x", base, 16, torch.float32)
    # Features at their "off" values are no reason to refuse.
    off: dict[str, Any] = {k: False if isinstance(v, bool) else None for k, v in option.items()}
    write_adapter(tmp_path / "off", base, **off)
    assert read_adapter(tmp_path / "off", "off", base, 16, torch.float32).rank == 4


def test_unreadable_files_are_named_not_located(tmp_path: Path, loaded: LoadedModel) -> None:
    base = BaseShapes.of_model(loaded.model)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / CONFIG_FILE).write_text('{"peft_type": "LORA", "r": 4}')
    for path in (tmp_path / "a", tmp_path / "missing"):
        with pytest.raises(AdapterError, match=r"cannot read .*: No such file") as refused:
            read_adapter(path, "a", base, 16, torch.float32)
        assert str(tmp_path) not in str(refused.value)
    registry = AdapterRegistry(LoraSettings(tmp_path), base, torch.float32, torch.device("cpu"))
    with pytest.raises(AdapterError, match="not a directory on the site") as refused:
        registry.register("b", tmp_path / "nowhere")
    assert str(tmp_path) not in str(refused.value)
    registry.close()


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two adapters saved by peft (random A and B): `no-alpha`, its config stripped of
    lora_alpha, and `nan`, one of its weights NaN. Plus a staging copy of `nan` to register."""
    import peft

    root = tmp_path_factory.mktemp("adapters")
    for seed, name in enumerate(("no-alpha", "nan")):
        torch.manual_seed(59 + seed)
        base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
        config = peft.LoraConfig(r=4, lora_alpha=PEFT_DEFAULT_ALPHA, init_lora_weights=False,
                                 target_modules=["q_proj", "v_proj", "gate_proj"])  # fmt: skip
        peft.get_peft_model(base, config).save_pretrained(str(root / name))
    settings = json.loads((root / "no-alpha" / CONFIG_FILE).read_text())
    del settings["lora_alpha"]
    (root / "no-alpha" / CONFIG_FILE).write_text(json.dumps(settings))
    _poke(root / "nan", float("nan"))
    staging = tmp_path_factory.mktemp("staging") / "nan"
    staging.mkdir()
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        (staging / file).write_bytes((root / "nan" / file).read_bytes())
    return root, staging


def _peft_answer(tiny_llama_dir: Path, adapter: Path | None, prompt: tuple[int, ...]) -> list[int]:
    import peft

    model: Any = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter))
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.eval().generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                    max_new_tokens=MAX_TOKENS, do_sample=False)  # fmt: skip
    return list(out[0, ids.shape[1] :].tolist())


def test_a_nan_adapter_is_refused_and_the_others_answer_as_peft_does(
    tiny_llama_dir: Path, adapters: tuple[Path, Path], loaded: LoadedModel
) -> None:
    """A NaN adapter, a second adapter (no lora_alpha in its config) and base rows, added at
    once: the NaN adapter's request fails at its load, before any step; the others are
    PeftModel's answers. Registering the NaN adapter (the admin API's LoadAdapter) is refused
    as invalid, with no path in the message."""
    root, staging = adapters
    lora = LoraSettings(root, max_loras=2, max_cpu_loras=2, max_rank=8)
    engine = PagedEngine(loaded, EngineConfig(max_num_seqs=4, block_size=4, lora=lora))
    prompt = (11, 402, 77, 1290, 5, 9, 31)
    sampling = SamplingParams(MAX_TOKENS, temperature=0.0)
    for rid, adapter in (("base", None), ("no-alpha", "no-alpha"), ("nan", "nan"),
                         ("base-2", None)):  # fmt: skip
        engine.add_request(EngineRequest(rid, prompt, sampling, adapter=adapter))
    done = drain(engine)
    assert done["nan"][1] is FinishReason.ERROR
    assert "layer 1 v_proj lora_B holds NaN" in done["nan"][2]
    assert str(root) not in done["nan"][2]
    base = _peft_answer(tiny_llama_dir, None, prompt)
    assert done["base"][0] == done["base-2"][0] == base
    # peft's alpha of 8 at rank 4 (scaling 2), not alpha = r (scaling 1, the old default).
    assert done["no-alpha"][0] == _peft_answer(tiny_llama_dir, root / "no-alpha", prompt)
    assert done["no-alpha"][0] != base
    assert engine.adapters is not None and engine.adapters.resident == ("no-alpha",)  # noqa: PT018
    # The loads and the waits as the site's metrics show them: one load, one refused, two
    # requests that waited (base rows never wait).
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector("s1", FixedStats(engine.stats())))
    samples = parse(generate_latest(registry).decode())
    assert scalar(samples, "fedllm_site_adapter_loads_total") == 1
    assert scalar(samples, "fedllm_site_adapter_load_failures_total") == 1
    assert scalar(samples, "fedllm_site_adapter_waits_total") == 2
    assert 0 < scalar(samples, "fedllm_site_adapter_wait_seconds_total") < 120
    with pytest.raises(AdapterRefused, match="holds NaN") as refused:
        engine.load_adapter("nan-again", str(staging))
    assert refused.value.reason == AdapterRefused.INVALID
    assert str(staging) not in str(refused.value)
    assert "nan-again" not in engine.served_adapters()
    engine.close()


def test_a_site_advertises_only_the_adapters_it_can_load(
    tmp_path: Path, loaded: LoadedModel
) -> None:
    """What SiteInfo.adapters (so the gateway's /v1/models) lists: not an adapter whose config
    or shapes fail the checks, nor one a load refused (NaN weights), until its files change."""
    base = BaseShapes.of_model(loaded.model)
    write_adapter(tmp_path / "good", base)
    write_adapter(tmp_path / "too-big", base, rank=32)
    write_adapter(tmp_path / "aLoRA", base, alora_invocation_tokens=[5])
    _poke(write_adapter(tmp_path / "nan", base, targets=("q_proj", "v_proj")), float("nan"))
    registry = AdapterRegistry(LoraSettings(tmp_path), base, torch.float32, torch.device("cpu"))
    assert registry.entries() == ("aLoRA", "good", "nan", "too-big")
    assert registry.served() == ("good", "nan")  # NaN shows only in the data
    with pytest.raises(AdapterError, match="holds NaN"):
        registry.load("nan")
    assert registry.served() == ("good",)
    tensors = load_file(str(tmp_path / "nan" / WEIGHTS_FILE))
    tensors[KEY] = torch.nan_to_num(tensors[KEY])
    fixed = tmp_path / "nan" / WEIGHTS_FILE
    save_file(tensors, str(fixed))  # fixed in place, the same size: told by its mtime
    mtime = fixed.stat().st_mtime_ns + 10**9  # coarse file clocks: a second later, surely
    os.utime(fixed, ns=(mtime, mtime))
    assert registry.served() == ("good", "nan")
    assert registry.load("nan").rank == 4
    registry.close()


def test_host_memory_keeps_adapters_within_its_bytes(tmp_path: Path, loaded: LoadedModel) -> None:
    """With max_cpu_bytes, host memory holds at most that many bytes of adapters (least
    recently used evicted first) however many max_cpu_loras would allow, but never evicts one
    in use; and the site setting in GiB becomes those bytes."""
    base = BaseShapes.of_model(loaded.model)
    for i in range(4):
        write_adapter(tmp_path / f"a{i}", base, seed=i)
    one = read_adapter(tmp_path / "a0", "a0", base, 16, torch.float32).num_bytes
    settings = LoraSettings(tmp_path, max_loras=1, max_cpu_loras=8, max_cpu_bytes=2 * one)
    registry = AdapterRegistry(settings, base, torch.float32, torch.device("cpu"))
    for name in ("a0", "a1", "a2"):
        registry.load(name)
    assert list(registry.resident) == ["a1", "a2"]
    assert registry.host_bytes == 2 * one
    registry.load("a3", in_use=("a1", "a2"))  # over the bound for a while: none evictable
    assert list(registry.resident) == ["a1", "a2", "a3"]
    registry.load("a0")
    assert list(registry.resident) == ["a3", "a0"]
    registry.close()
    with pytest.raises(ValueError, match="max_cpu_bytes must be >= 0"):
        LoraSettings(tmp_path, max_cpu_bytes=-1)
    site = SiteSettings.load({"SITE_MODEL_DIR": "m", "SITE_LORA_DIR": str(tmp_path),
                              "SITE_MAX_CPU_LORA_GIB": "0.5"})  # fmt: skip
    lora = lora_settings(site)
    assert lora is not None and lora.max_cpu_bytes == 1 << 29  # noqa: PT018
    with pytest.raises(SettingsError, match="SITE_MAX_CPU_LORA_GIB must be >= 0"):
        SiteSettings.load({"SITE_MODEL_DIR": "m", "SITE_MAX_CPU_LORA_GIB": "-1"})
