"""A real site process loading and unloading a LoRA adapter at run time over real gRPC
(LoadAdapter / UnloadAdapter): a loaded adapter is served at once, like its merged model; one
that does not fit the base is refused with nothing changed; an unloaded one is refused again;
an adapter with a live request is not unloaded."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from devtools.launch import ManagedProcess, start_site
from fedllm_contract.proto import site_pb2, site_pb2_grpc
from site_engine.engine.lora.adapter import BaseShapes
from tests.integration.test_site_lora import PROMPT, RANK, generate, merged_answer
from tests.unit.engine.test_lora_adapters import write_adapter

pytestmark = pytest.mark.slow
TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def sources(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Adapters outside the site's adapter directory, as an operator would upload them."""
    root = tmp_path_factory.mktemp("uploads")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    base = BaseShapes.of_model(model)
    write_adapter(root / "tenant-b", base, rank=RANK, targets=TARGETS)
    write_adapter(root / "tenant-c", base, rank=RANK, targets=TARGETS, seed=1)
    write_adapter(root / "too-big", base, rank=16, targets=TARGETS)  # the site takes rank <= 8
    return root


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("served")


@pytest.fixture(scope="module")
def stub(
    tiny_llama_dir: Path, lora_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[site_pb2_grpc.SiteEngineStub]:
    args = ["--lora-dir", str(lora_dir), "--max-loras", "1", "--max-lora-rank", "8"]
    process: ManagedProcess = start_site(
        extra_args=args,
        model_dir=tiny_llama_dir,
        site_name="lora-load-test",
        model_name="tiny",
        log_dir=tmp_path_factory.mktemp("logs"),
    )
    with grpc.insecure_channel(f"127.0.0.1:{process.port}") as channel:
        yield site_pb2_grpc.SiteEngineStub(channel)
    process.stop()


def served(stub: site_pb2_grpc.SiteEngineStub) -> list[str]:
    return list(stub.Info(site_pb2.InfoRequest()).adapters)


def refusal(call: object) -> grpc.RpcError:
    """The RpcError `call` (a thunk) raises."""
    assert callable(call)
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value


def test_an_adapter_loaded_at_run_time_is_served_then_unloaded(
    stub: site_pb2_grpc.SiteEngineStub, tiny_llama_dir: Path, sources: Path, lora_dir: Path
) -> None:
    assert served(stub) == []
    before = refusal(lambda: generate(stub, "tenant-b"))
    assert before.code() == grpc.StatusCode.INVALID_ARGUMENT

    load = site_pb2.LoadAdapterRequest(name="tenant-b", path=str(sources / "tenant-b"))
    assert list(stub.LoadAdapter(load, timeout=60).adapters) == ["tenant-b"]
    assert served(stub) == ["tenant-b"]
    assert generate(stub, "tenant-b") == merged_answer(tiny_llama_dir, sources / "tenant-b")
    again = refusal(lambda: stub.LoadAdapter(load, timeout=60))
    assert again.code() == grpc.StatusCode.ALREADY_EXISTS

    unload = site_pb2.UnloadAdapterRequest(name="tenant-b")
    assert list(stub.UnloadAdapter(unload, timeout=60).adapters) == []
    after = refusal(lambda: generate(stub, "tenant-b"))
    assert after.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (sources / "tenant-b" / "adapter_model.safetensors").is_file()  # only the link went
    assert list(lora_dir.iterdir()) == []
    gone = refusal(lambda: stub.UnloadAdapter(unload, timeout=60))
    assert gone.code() == grpc.StatusCode.NOT_FOUND


def answer(stub: site_pb2_grpc.SiteEngineStub, adapter: str, prompt: list[int]) -> list[int]:
    request = site_pb2.GenerateRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=prompt,
        sampling=site_pb2.SamplingParams(max_tokens=8, temperature=0),
        adapter=adapter,
    )
    return [t for chunk in stub.Generate(request, timeout=60) for t in chunk.token_ids]


def test_a_name_loaded_again_serves_its_new_weights_not_the_old_cache(
    stub: site_pb2_grpc.SiteEngineStub, sources: Path
) -> None:
    prompt = PROMPT * 4  # full KV blocks (16 tokens), which the prefix cache keeps
    control = site_pb2.LoadAdapterRequest(name="control", path=str(sources / "tenant-c"))
    stub.LoadAdapter(control, timeout=60)
    expected = answer(stub, "control", prompt)
    stub.UnloadAdapter(site_pb2.UnloadAdapterRequest(name="control"), timeout=60)

    old = site_pb2.LoadAdapterRequest(name="reused", path=str(sources / "tenant-b"))
    stub.LoadAdapter(old, timeout=60)
    first = answer(stub, "reused", prompt)  # its prompt's blocks are cached under the name
    unload = site_pb2.UnloadAdapterRequest(name="reused")
    stub.UnloadAdapter(unload, timeout=60)
    new = site_pb2.LoadAdapterRequest(name="reused", path=str(sources / "tenant-c"))
    stub.LoadAdapter(new, timeout=60)
    assert first != expected
    assert answer(stub, "reused", prompt) == expected
    stub.UnloadAdapter(unload, timeout=60)


def test_an_adapter_that_does_not_fit_is_refused_and_nothing_changes(
    stub: site_pb2_grpc.SiteEngineStub, sources: Path, lora_dir: Path
) -> None:
    before = served(stub)
    load = site_pb2.LoadAdapterRequest(name="too-big", path=str(sources / "too-big"))
    refused = refusal(lambda: stub.LoadAdapter(load, timeout=60))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rank" in (refused.details() or "")
    missing = site_pb2.LoadAdapterRequest(name="nowhere", path=str(sources / "nowhere"))
    assert refusal(lambda: stub.LoadAdapter(missing)).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert served(stub) == before
    assert list(lora_dir.iterdir()) == []
    assert generate(stub, "")  # still serving


def test_an_adapter_with_a_live_request_is_not_unloaded(
    stub: site_pb2_grpc.SiteEngineStub, sources: Path
) -> None:
    load = site_pb2.LoadAdapterRequest(name="busy", path=str(sources / "tenant-b"))
    stub.LoadAdapter(load, timeout=60)
    request_id = uuid.uuid4().hex
    long = site_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        sampling=site_pb2.SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True),
        adapter="busy",
    )
    stream = stub.Generate(long, timeout=120)
    assert next(stream).accepted  # admitted: the request is live
    unload = site_pb2.UnloadAdapterRequest(name="busy")
    refused = refusal(lambda: stub.UnloadAdapter(unload, timeout=60))
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert served(stub) == ["busy"]
    stub.Cancel(site_pb2.CancelRequest(request_id=request_id))
    for _ in stream:  # to its end (cancelled)
        pass
    assert list(stub.UnloadAdapter(unload, timeout=60).adapters) == []
