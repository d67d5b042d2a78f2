"""LoRA adapters in PEFT's format: what is refused (with nothing changed), the per-row delta
math, and the engine's handling of unknown, invalid and loading adapters. A tiny random Llama;
the adapter files are written as PEFT writes them (tests/unit/engine/test_lora_correctness.py
makes real ones with peft and checks the answers against PeftModel)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from site_engine.engine.core.api import EngineRequest, RequestRejected
from site_engine.engine.core.types import FinishReason, SamplingParams
from site_engine.engine.lora import registry as lora_registry
from site_engine.engine.lora.adapter import AdapterError, BaseShapes, LoraAdapter, read_adapter
from site_engine.engine.lora.registry import AdapterRegistry, LoraSettings
from site_engine.engine.lora.slots import LoraSlots
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel, load_model

PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(tiny_llama_dir)


def base_of(loaded: LoadedModel) -> BaseShapes:
    return BaseShapes.of_model(loaded.model)


def write_adapter(
    path: Path,
    base: BaseShapes,
    *,
    rank: int = 4,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    layers: int | None = None,
    shape_of: dict[str, tuple[int, int]] | None = None,
    seed: int = 0,
    **config: Any,
) -> Path:
    """A PEFT LoRA adapter directory as PeftModel.save_pretrained writes one."""
    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(base.num_layers if layers is None else layers):
        for proj in targets:
            in_f, out_f = (shape_of or base.features)[proj]
            parent = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"{PREFIX}.{layer}.{parent}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.1
    save_file(tensors, str(path / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                "target_modules": list(targets), "bias": "none", **config}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(settings))
    return path


def test_a_valid_adapter_reads_with_its_scaling(tmp_path: Path, loaded: LoadedModel) -> None:
    base = base_of(loaded)
    path = write_adapter(tmp_path / "ok", base, rank=8, targets=("q_proj", "down_proj"))
    adapter = read_adapter(path, "ok", base, max_rank=16, dtype=torch.float32)
    assert (adapter.rank, adapter.scaling) == (8, 2.0)
    assert adapter.projections == {"q_proj", "down_proj"}
    a, b = adapter.weights[(1, "down_proj")]
    assert a.shape == (base.features["down_proj"][0], 8)
    assert b.shape == (8, base.features["down_proj"][1])
    rs = write_adapter(tmp_path / "rs", base, rank=4, use_rslora=True, lora_alpha=8)
    assert read_adapter(rs, "rs", base, 16, torch.float32).scaling == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rank": 32}, "rank 32 is outside 1..16"),
        ({"rank": 65}, "rank 65 is outside"),
        ({"shape_of": {"q_proj": (96, 96), "v_proj": (96, 32)}}, "do not fit the base"),
        ({"layers": 3}, "the base model has 2 layers"),
        ({"use_dora": True}, "DoRA is not supported"),
        ({"bias": "all"}, "bias 'all' is not supported"),
        ({"rank_pattern": {"q_proj": 8}}, "per-module ranks"),
        ({"targets": ("qkv_proj",), "shape_of": {"qkv_proj": (64, 128)}}, "qkv_proj is not one"),
    ],
)
def test_an_adapter_that_does_not_fit_is_refused_and_changes_nothing(
    tmp_path: Path, loaded: LoadedModel, options: dict[str, Any], message: str
) -> None:
    base = base_of(loaded)
    if "shape_of" in options:  # e.g. an adapter of another model (hidden size 96)
        options["shape_of"] = {**base.features, **options["shape_of"]}
    write_adapter(tmp_path / "good", base, seed=1)
    write_adapter(tmp_path / "bad", base, **options)
    registry = AdapterRegistry(
        LoraSettings(tmp_path, max_loras=2, max_cpu_loras=2, max_rank=16),
        base,
        torch.float32,
        torch.device("cpu"),
    )
    registry.load("good")
    slots_before = {name: t.clone() for name, t in registry.slots.a.items()}
    with pytest.raises(AdapterError, match=message):
        registry.load("bad")
    assert registry.resident == ("good",)
    assert registry.slots.slot_of("bad") is None
    assert all(torch.equal(registry.slots.a[n], t) for n, t in slots_before.items())
    registry.close()


def test_missing_files_and_unknown_names_are_refused(tmp_path: Path, loaded: LoadedModel) -> None:
    base = base_of(loaded)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    with pytest.raises(AdapterError, match=r"cannot read .*adapter_model\.safetensors"):
        read_adapter(tmp_path / "empty", "empty", base, 16, torch.float32)
    registry = AdapterRegistry(LoraSettings(tmp_path), base, torch.float32, torch.device("cpu"))
    for name in ("nope", "..", "../empty"):
        with pytest.raises(AdapterError, match="unknown adapter"):
            registry.check_name(name)
    assert registry.entries() == ("empty",)
    assert registry.served() == ()  # no weights file: not advertised
    registry.close()


def test_each_row_gets_its_own_slots_delta_with_mixed_ranks(loaded: LoadedModel) -> None:
    base = base_of(loaded)
    gen = torch.Generator().manual_seed(3)
    in_f, out_f = base.features["q_proj"]

    def adapter(name: str, rank: int, scaling: float) -> LoraAdapter:
        a = torch.randn(in_f, rank, generator=gen)
        b = torch.randn(rank, out_f, generator=gen)
        return LoraAdapter.from_pairs(name, rank, scaling, {(1, "q_proj"): (a, b)}, base, 8)

    adapters = {"r2": adapter("r2", 2, 0.5), "r8": adapter("r8", 8, 2.0)}
    slots = LoraSlots(
        base, num_slots=3, max_rank=8, dtype=torch.float32, device=torch.device("cpu")
    )
    where = slots.assign(["r8", "r2"], adapters.__getitem__)
    rows = ["r2", "", "r8", "r2", ""]
    token_slots = torch.tensor([where[n] if n else -1 for n in rows])
    x = torch.randn(len(rows), in_f, generator=gen)
    linear = torch.nn.Linear(in_f, out_f)
    with torch.inference_mode():
        got = slots.step(token_slots).project(1, "q_proj", linear, x)
        base_out = linear(x)
        untargeted = slots.step(token_slots).project(0, "q_proj", linear, x)
    for i, name in enumerate(rows):
        expected = base_out[i]
        if name:
            a, b = adapters[name].weights[(1, "q_proj")]
            expected = expected + (x[i] @ a @ b) * adapters[name].scaling
        torch.testing.assert_close(got[i], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(untargeted, base_out)  # layer 0 has no delta


def engine(loaded: LoadedModel, root: Path, **settings: Any) -> PagedEngine:
    lora = LoraSettings(root, **{"max_loras": 2, "max_cpu_loras": 2, "max_rank": 8, **settings})
    config = EngineConfig(max_num_seqs=4, block_size=4, model_name="tiny", lora=lora)
    return PagedEngine(loaded, config)


def drain(eng: PagedEngine) -> dict[str, tuple[list[int], FinishReason, str]]:
    done: dict[str, tuple[list[int], FinishReason, str]] = {}
    tokens: dict[str, list[int]] = {}
    for _ in range(500):
        if not eng.has_unfinished():
            return done
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                done[out.request_id] = (tokens[out.request_id], out.finish_reason, out.error)
    raise AssertionError("the engine stopped making progress")


def request(rid: str, adapter: str | None) -> EngineRequest:
    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return EngineRequest(rid, (5, 6, 7, 8, 9), sampling, adapter=adapter)


def test_the_engine_refuses_unknown_adapters_and_fails_invalid_ones_alone(
    tmp_path: Path, loaded: LoadedModel
) -> None:
    base = base_of(loaded)
    write_adapter(tmp_path / "good", base, targets=("q_proj", "gate_proj", "down_proj"))
    write_adapter(tmp_path / "too-big", base, rank=16)
    eng = engine(loaded, tmp_path)
    assert eng.served_adapters() == ("good",)  # too-big's rank: not advertised
    with pytest.raises(RequestRejected, match="unknown adapter 'other'"):
        eng.add_request(request("r0", "other"))
    for rid, adapter in (("base", None), ("good", "good"), ("bad", "too-big")):
        eng.add_request(request(rid, adapter))
    done = drain(eng)
    assert done["bad"][1] is FinishReason.ERROR
    assert "rank 16 is outside 1..8" in done["bad"][2]
    assert done["base"][1] is done["good"][1] is FinishReason.LENGTH
    assert done["good"][0] != done["base"][0]  # the adapter changes the answer
    assert eng.adapters is not None
    assert eng.adapters.resident == ("good",)
    # The same prompt again: the adapter's own cached prefix, the same answer.
    eng.add_request(request("good-again", "good"))
    assert drain(eng)["good-again"][0] == done["good"][0]
    eng.close()


def test_a_site_without_adapters_refuses_a_request_for_one(loaded: LoadedModel) -> None:
    eng = PagedEngine(loaded, EngineConfig(max_num_seqs=2, block_size=4))
    assert eng.served_adapters() == ()
    with pytest.raises(RequestRejected, match="serves no LoRA adapters"):
        eng.add_request(request("r", "good"))
    eng.close()


def test_host_memory_keeps_max_cpu_loras_but_never_evicts_one_in_use(
    tmp_path: Path, loaded: LoadedModel
) -> None:
    base = base_of(loaded)
    for seed, name in enumerate("abcd"):
        write_adapter(tmp_path / name, base, seed=seed)
    settings = LoraSettings(tmp_path, max_loras=1, max_cpu_loras=2, max_rank=8)
    registry = AdapterRegistry(settings, base, torch.float32, torch.device("cpu"))
    assert registry.request("a") is False  # loading on the worker thread
    assert registry.request("a") is False  # once
    for _ in range(100):
        registry.wait(1.0)
        ready, failed = registry.settle(lambda: {"a"})
        if ready or failed:
            break
    assert (ready, failed) == (["a"], {})
    assert not registry.loading
    assert registry.resident == ("a",)
    assert registry.request("a") is True
    registry.load("b", in_use={"a"})
    registry.load("c", in_use={"a"})  # b goes: a is in use
    assert list(registry.resident) == ["a", "c"]
    registry.load("d", in_use={"a", "c"})  # nothing may go: one over for a while
    assert list(registry.resident) == ["a", "c", "d"]
    registry.close()


@pytest.mark.parametrize("max_loads", [1, 2])
def test_a_request_waits_for_its_own_adapters_load_only(
    tmp_path: Path, loaded: LoadedModel, max_loads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter whose load is held (its read waits for the test; the files are real, and its
    weights file is not a safetensors file): with two loaders the other adapter loads and runs
    meanwhile; with one it queues behind (what made cold adapters at 1,000 adapters wait
    seconds). The hold was a FIFO as the weights file until loads refused FIFOs (issue 58)."""
    base = base_of(loaded)
    write_adapter(tmp_path / "fast", base)
    write_adapter(tmp_path / "slow", base, seed=1)
    (tmp_path / "slow" / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    release = threading.Event()

    def held(path: Path, name: str, *args: Any, **kwargs: Any) -> LoraAdapter:
        if name == "slow":
            release.wait(60)
        return read_adapter(path, name, *args, **kwargs)

    monkeypatch.setattr(lora_registry, "read_adapter", held)
    eng = engine(loaded, tmp_path, max_loads=max_loads)
    try:
        for rid, adapter in (("slow", "slow"), ("fast", "fast"), ("base", None)):
            eng.add_request(request(rid, adapter))
        done: set[str] = set()
        for _ in range(200):
            done |= {out.request_id for out in eng.step() if out.finish_reason is not None}
            if "base" in done and ("fast" in done or max_loads == 1):
                break
        assert "base" in done
        assert "slow" not in done
        assert ("fast" in done) is (max_loads > 1)
    finally:
        release.set()  # the held load reads the bad file and fails
    left = drain(eng)
    assert left["slow"][1] is FinishReason.ERROR
    assert "slow" in left["slow"][2]
    if max_loads == 1:
        assert left["fast"][1] is FinishReason.LENGTH
    eng.close()


def test_loads_finishing_together_keep_the_host_lru_in_bounds(
    tmp_path: Path, loaded: LoadedModel
) -> None:
    """Four loads on four workers, collected by one settle: all kept while in use (over the
    bound for a while), then the next adapter in evicts the oldest down to max_cpu_loras."""
    base = base_of(loaded)
    for seed, name in enumerate("abcde"):
        write_adapter(tmp_path / name, base, seed=seed)
    with pytest.raises(ValueError, match="max_lora_loads must be >= 1, got 0"):
        LoraSettings(tmp_path, max_loads=0)
    settings = LoraSettings(tmp_path, max_loras=1, max_cpu_loras=2, max_rank=8, max_loads=4)
    registry = AdapterRegistry(settings, base, torch.float32, torch.device("cpu"))
    assert [registry.request(name) for name in "abcd"] == [False] * 4
    ready: list[str] = []
    for _ in range(500):
        if not registry.loading:
            break
        registry.wait(1.0)
        got, failed = registry.settle(lambda: set("abcd"))
        assert failed == {}
        ready += got
    assert sorted(ready) == list("abcd")
    assert sorted(registry.resident) == list("abcd")  # all in use: none evicted
    registry.load("e", in_use=set())
    assert len(registry.resident) == 2
    assert registry.resident[-1] == "e"
    registry.close()


def _header_of(data: bytes) -> dict[str, Any]:
    length = int.from_bytes(data[:8], "little")
    header: dict[str, Any] = json.loads(data[8 : 8 + length])
    return header


def _with_header(data: bytes, header: dict[str, Any]) -> bytes:
    length = int.from_bytes(data[:8], "little")
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data[8 + length :]


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda d: d[:5], "not a safetensors file"),
        (lambda d: (10**9).to_bytes(8, "little") + d[8:], "not a safetensors file"),
        (lambda d: d[:-4], "do not fit"),
        (lambda d: _with_header(d, {k: {**v, "dtype": "I32"} if k != "__metadata__" else v
                                    for k, v in _header_of(d).items()}), "not a float type"),
        (lambda d: _with_header(d, {k: {**v, "shape": [1]} if k != "__metadata__" else v
                                    for k, v in _header_of(d).items()}), "do not fit"),
    ],
)  # fmt: skip
def test_a_malformed_weights_file_is_refused_before_its_data_is_read(
    tmp_path: Path, loaded: LoadedModel, corrupt: Any, message: str
) -> None:
    base = base_of(loaded)
    path = write_adapter(tmp_path / "bad", base)
    weights = path / "adapter_model.safetensors"
    weights.write_bytes(corrupt(weights.read_bytes()))
    with pytest.raises(AdapterError, match=f"cannot read .*{message}"):
        read_adapter(path, "bad", base, 16, torch.float32)
