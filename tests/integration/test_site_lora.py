"""A real site process serving a LoRA adapter over real gRPC: `--lora-dir` makes the adapter
servable by name, its answers are those of the base with the adapter merged into its weights
(transformers `generate`, the deployment a LoRA serving engine saves), a base request in the
same site is unchanged, and an adapter the site does not hold is refused at the boundary."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from devtools.launch import ManagedProcess, start_site
from fedllm_contract.proto import site_pb2, site_pb2_grpc
from site_engine.engine.lora.adapter import BaseShapes
from tests.unit.engine.test_lora_adapters import write_adapter

pytestmark = pytest.mark.slow
PROMPT = [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]
RANK, ALPHA = 4, 8  # write_adapter's alpha is 2 * rank: scaling 2


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    targets = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")
    write_adapter(root / "tenant-a", BaseShapes.of_model(model), rank=RANK, targets=targets)
    return root


@pytest.fixture(scope="module")
def stub(
    tiny_llama_dir: Path, adapter_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[site_pb2_grpc.SiteEngineStub]:
    args = ["--lora-dir", str(adapter_dir), "--max-loras", "1", "--max-lora-rank", "8"]
    process: ManagedProcess = start_site(
        extra_args=args,
        model_dir=tiny_llama_dir,
        site_name="lora-test",
        model_name="tiny",
        log_dir=tmp_path_factory.mktemp("logs"),
    )
    with grpc.insecure_channel(f"127.0.0.1:{process.port}") as channel:
        yield site_pb2_grpc.SiteEngineStub(channel)
    process.stop()


def generate(stub: site_pb2_grpc.SiteEngineStub, adapter: str) -> list[int]:
    request = site_pb2.GenerateRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=PROMPT,
        sampling=site_pb2.SamplingParams(max_tokens=8, temperature=0),
        adapter=adapter,
    )
    return [t for chunk in stub.Generate(request, timeout=60) for t in chunk.token_ids]


def merged_answer(model_dir: Path, adapter: Path | None) -> list[int]:
    """transformers' greedy answer with the adapter's deltas merged into the weights."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if adapter is not None:
        tensors = load_file(str(adapter / "adapter_model.safetensors"))
        prefix = "base_model.model."
        with torch.no_grad():
            for key, a in tensors.items():
                if key.endswith("lora_A.weight"):
                    b = tensors[key.replace("lora_A", "lora_B")]
                    module = model.get_submodule(key[len(prefix) : -len(".lora_A.weight")])
                    module.get_parameter("weight").add_(b @ a * (ALPHA / RANK))
    prompt = torch.tensor([PROMPT])
    out = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=8
    )
    return list(out[0, len(PROMPT) :].tolist())


def test_an_adapter_is_served_by_name_like_its_merged_model(
    stub: site_pb2_grpc.SiteEngineStub, tiny_llama_dir: Path, adapter_dir: Path
) -> None:
    tuned = generate(stub, "tenant-a")
    assert tuned == merged_answer(tiny_llama_dir, adapter_dir / "tenant-a")
    base = generate(stub, "")
    assert base == merged_answer(tiny_llama_dir, None)
    assert tuned != base
    assert generate(stub, "tenant-a") == tuned  # again, from its own cached prefix


def test_the_site_lists_its_adapters(stub: site_pb2_grpc.SiteEngineStub) -> None:
    assert list(stub.Info(site_pb2.InfoRequest()).adapters) == ["tenant-a"]


def test_an_adapter_the_site_does_not_hold_is_refused(stub: site_pb2_grpc.SiteEngineStub) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        generate(stub, "tenant-b")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "adapter 'tenant-b' is not served by this site" in (refused.value.details() or "")
    assert generate(stub, "")  # still serving
