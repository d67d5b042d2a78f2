"""POST /v1/embeddings through a real gateway to real sites serving all-MiniLM-L6-v2, called with
the openai SDK: one site engine reached over gRPC and the same engine's OpenAI HTTP face as a
site of kind `openai` (the gateway passes /v1/embeddings through to it), next to a chat model's
site. The vectors are those the model gives computed directly with transformers; the request is
recorded and billed to its key; the wrong model on either side is a clear 404."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from devtools.launch import (
    ManagedProcess,
    free_port,
    spawn_site,
    start_gateway,
    stop_all,
    wait_until_serving,
)
from tests.e2e.conftest import Federation
from tests.support.api_keys import make_key

pytestmark = pytest.mark.slow
ADMIN = "embeddings-admin-token-0123456789"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A federation of sites serves one model.",
    "Embeddings turn text into vectors.",
    "short",
    "Paris is the capital of France, and Berlin that of Germany.",
]


@dataclass
class Reference:
    """all-MiniLM-L6-v2 computed directly: transformers' encoder, mean pooling, L2 norm."""

    model: torch.nn.Module
    tokenizer: AutoTokenizer

    def ids(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer(text)["input_ids"]
        return ids

    @torch.inference_mode()
    def vector(self, text: str) -> torch.Tensor:
        batch = self.tokenizer([text], return_tensors="pt")
        hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        return torch.nn.functional.normalize(pooled, dim=1)[0]


def cosine(a: list[float], b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=0))


@pytest.fixture(scope="module")
def reference(minilm_dir: Path) -> Reference:
    return Reference(AutoModel.from_pretrained(str(minilm_dir)).eval(),
                     AutoTokenizer.from_pretrained(str(minilm_dir)))  # fmt: skip


@pytest.fixture(scope="module")
def federation(
    tiny_llama_dir: Path, minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Federation]:
    """A chat model's site, and one MiniLM site engine seen as two sites: over gRPC, and over
    its OpenAI HTTP face (kind `openai`)."""
    work = tmp_path_factory.mktemp("embeddings")
    http_port = free_port()
    sites = {
        "chat": spawn_site(model_dir=tiny_llama_dir, site_name="chat", model_name="tiny",
                           log_dir=work),
        "minilm": spawn_site(model_dir=minilm_dir, site_name="minilm-grpc", model_name="minilm",
                             log_dir=work, extra_args=["--http-port", str(http_port)]),
    }  # fmt: skip
    started: list[ManagedProcess] = list(sites.values())
    try:
        for process in sites.values():
            wait_until_serving(process)
        base = f"http://127.0.0.1:{http_port}"
        place = {"cloud": "aws", "region": "us-east-1"}
        config = {
            "models": [
                {"name": "tiny", "tokenizer": str(tiny_llama_dir)},
                {"name": "minilm", "tokenizer": str(minilm_dir), "task": "embed"},
            ],
            "sites": [
                {"name": "chat", **place, "endpoint": f"127.0.0.1:{sites['chat'].port}",
                 "model": "tiny"},
                {"name": "minilm-grpc", **place, "endpoint": f"127.0.0.1:{sites['minilm'].port}",
                 "model": "minilm"},
                {"name": "minilm-http", **place, "model": "minilm", "kind": "openai",
                 "base_url": f"{base}/v1", "metrics_url": f"{base}/metrics",
                 "metrics_dialect": "vllm", "metrics_interval_ms": 200},
            ],
        }  # fmt: skip
        path = work / "federation.json"
        path.write_text(json.dumps(config))
        url = f"sqlite+aiosqlite:///{work / 'gateway.db'}"
        gateway = start_gateway(
            federation_file=path,
            database_url=url,
            log_dir=work,
            expect_healthy_sites=3,
            env={"GATEWAY_ADMIN_TOKEN": ADMIN},
        )
        started.append(gateway)
        yield Federation(gateway, sites, url)
    finally:
        stop_all(list(reversed(started)))


@pytest.fixture(scope="module")
def client(federation: Federation) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{federation.base_url}/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:
        yield client


def test_models_lists_the_embedding_model(client: openai.OpenAI) -> None:
    assert sorted(model.id for model in client.models.list()) == ["minilm", "tiny"]


def test_one_input_is_the_models_own_vector(client: openai.OpenAI, reference: Reference) -> None:
    # The SDK asks for base64 by default and decodes it: the base64 path, as clients use it.
    answer = client.embeddings.create(model="minilm", input=TEXTS[0])
    assert answer.object == "list"
    assert answer.model == "minilm"
    (item,) = answer.data
    assert (item.object, item.index, len(item.embedding)) == ("embedding", 0, 384)
    assert cosine(item.embedding, reference.vector(TEXTS[0])) > 0.999
    tokens = len(reference.ids(TEXTS[0]))
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == tokens


def test_a_batch_in_both_encodings_keeps_its_order(
    client: openai.OpenAI, federation: Federation, reference: Reference
) -> None:
    floats = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    assert [item.index for item in floats.data] == list(range(len(TEXTS)))
    for text, item in zip(TEXTS, floats.data, strict=True):
        assert cosine(item.embedding, reference.vector(text)) > 0.999
    assert floats.usage.prompt_tokens == sum(len(reference.ids(t)) for t in TEXTS)
    # base64 as it travels: the float32 little-endian bytes of the same vectors.
    raw = httpx.post(f"{federation.base_url}/v1/embeddings", timeout=60, json={
        "model": "minilm", "input": TEXTS, "encoding_format": "base64"}).json()  # fmt: skip
    for item, float_item in zip(raw["data"], floats.data, strict=True):
        decoded = base64.b64decode(item["embedding"])
        assert len(decoded) == 384 * 4
        vector = struct.unpack("<384f", decoded)
        assert max(abs(a - b) for a, b in zip(vector, float_item.embedding, strict=True)) < 1e-5


def test_token_id_inputs_embed_the_same_text(client: openai.OpenAI, reference: Reference) -> None:
    ids = [reference.ids(text) for text in TEXTS[:2]]
    one = client.embeddings.create(model="minilm", input=ids[0], encoding_format="float")
    several = client.embeddings.create(model="minilm", input=ids, encoding_format="float")
    assert cosine(one.data[0].embedding, reference.vector(TEXTS[0])) > 0.999
    for text, item in zip(TEXTS[:2], several.data, strict=True):
        assert cosine(item.embedding, reference.vector(text)) > 0.999
    assert several.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_both_site_kinds_serve_the_model(
    client: openai.OpenAI, federation: Federation, reference: Reference
) -> None:
    """The gRPC site and the `openai` one (the engine's /v1/embeddings, passed through) both
    take requests, and give the same vectors. Each is made the only choice in turn by draining
    the other: both faces share one engine, so its load shows on both and least-token routing
    of sequential requests need not alternate."""
    expected = reference.vector(TEXTS[2])
    admin = {"Authorization": f"Bearer {ADMIN}"}
    sites = ("minilm-grpc", "minilm-http")
    for serving in sites:
        (other,) = (name for name in sites if name != serving)
        url = f"{federation.base_url}/admin/api/sites/{other}"
        assert httpx.post(f"{url}/drain", headers=admin, timeout=30).status_code == 200
        try:
            for _ in range(2):
                raw = client.embeddings.with_raw_response.create(model="minilm", input=TEXTS[2])
                assert raw.headers["x-fedllm-site"] == serving
                assert cosine(raw.parse().data[0].embedding, expected) > 0.999
        finally:
            assert httpx.post(f"{url}/undrain", headers=admin, timeout=30).status_code == 200


def test_requests_are_recorded_and_billed_to_their_key(
    client: openai.OpenAI, federation: Federation
) -> None:
    key = make_key(federation.base_url, ADMIN, "embedder")
    keyed = client.with_options(api_key=key)
    answers = [keyed.embeddings.create(model="minilm", input=TEXTS[:3]) for _ in range(2)]
    billed = sum(answer.usage.prompt_tokens for answer in answers)
    key_id = next(
        k["id"]
        for k in httpx.get(f"{federation.base_url}/admin/api/keys", timeout=30,
                           headers={"Authorization": f"Bearer {ADMIN}"}).json()["data"]
        if k["name"] == "embedder"
    )  # fmt: skip
    rows = federation.rows(f"r.api_key_id = {key_id}")
    assert len(rows) == 2
    for row in rows:
        assert (row["api"], row["model"], row["status"]) == ("embeddings", "minilm", "completed")
        assert (row["completion_tokens"], row["max_tokens"]) == (0, 0)
        assert row["site_name"] in ("minilm-grpc", "minilm-http")
    assert sum(int(str(row["prompt_tokens"])) for row in rows) == billed
    usage = httpx.get(f"{federation.base_url}/admin/api/keys/{key_id}/usage", timeout=30,
                      headers={"Authorization": f"Bearer {ADMIN}"}).json()  # fmt: skip
    assert (usage["requests"], usage["prompt_tokens"], usage["completion_tokens"]) == (
        2,
        billed,
        0,
    )


def test_a_chat_model_is_no_embedding_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        client.embeddings.create(model="tiny", input="hello")
    error = refused.value.body
    assert isinstance(error, dict)
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "no site serves an embedding model named 'tiny'" in error["message"]
    assert "embedding models here: minilm" in error["message"]


def test_the_embedding_model_does_not_chat_complete_or_respond(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as chat:
        client.chat.completions.create(
            model="minilm", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    message = str(chat.value)
    assert "model 'minilm' is an embedding model" in message
    assert "not at /v1/chat/completions; models for /v1/chat/completions here: tiny" in message
    with pytest.raises(openai.NotFoundError) as completion:
        client.completions.create(model="minilm", prompt="hi", max_tokens=4)
    assert "served at /v1/embeddings, not at /v1/completions" in str(completion.value)
    with pytest.raises(openai.NotFoundError) as response:
        client.responses.create(model="minilm", input="hi")
    assert "served at /v1/embeddings, not at /v1/responses" in str(response.value)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": "x", "dimensions": 64}, "dimensions", "gives 384-dimensional embeddings"),
        ({"input": "word " * 300}, "input", "maximum context length is 256 tokens"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", "must be one of"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": ["text", [1, 2]]}, "input", "not a mix"),
        ({"input": [""]}, "input", "empty string"),
        ({"input": [[101, 99999999]]}, "input", "token ids must be in"),
    ],
)
def test_bad_requests_are_400s_naming_the_parameter(
    federation: Federation, body: dict[str, object], param: str, says: str
) -> None:
    answer = httpx.post(f"{federation.base_url}/v1/embeddings", timeout=60,
                        json={"model": "minilm", **body})  # fmt: skip
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert says in error["message"]


def test_the_dashboard_shows_the_embedding_sites_healthy(federation: Federation) -> None:
    overview = httpx.get(f"{federation.base_url}/admin/api/overview", timeout=30,
                         headers={"Authorization": f"Bearer {ADMIN}"})  # fmt: skip
    assert overview.status_code == 200, overview.text
    healthy = {site["name"]: site["healthy"] for site in overview.json()["sites"]}
    assert healthy == {"chat": True, "minilm-grpc": True, "minilm-http": True}
