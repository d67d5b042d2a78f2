"""Preparing an embeddings request at the gateway (gateway/embeddings/prepare.py): OpenAI's four
input forms, tokenized as the model's tokenizer does by default, and clear 4xx for the rest;
and the openai-site wire for /v1/embeddings (gateway/sites/openai_wire.py)."""

from __future__ import annotations

import base64
import struct
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from gateway.embeddings.prepare import EmbeddingPreparer
from gateway.embeddings.request import EmbeddingRequest
from gateway.errors import InvalidRequest, NotFound
from gateway.federation import ModelConfig, OpenAISiteConfig, SiteConfig
from gateway.sites.interface import EmbedParams, SiteInfoView
from gateway.sites.openai_client import OpenAISiteClient
from gateway.sites.openai_wire import MalformedStream, embedding_body, parse_embeddings
from gateway.sites.registry import SiteRegistry, SiteState
from gateway.tokenizers import ModelTokenizers


@pytest.fixture(scope="module")
def tokenizers(minilm_dir: Path) -> ModelTokenizers:
    return ModelTokenizers((ModelConfig("minilm", minilm_dir, task="embed"),))


def _registry(tokenizers: ModelTokenizers, dimension: int) -> SiteRegistry:
    """One healthy site that says its context and vector length; its client (real, needing no
    event loop) is never called."""
    info = SiteInfoView("s", "minilm", 256, 30522, "f", "cpu", "float32", 1, 0, 8, "embedding",
                        "v", task="embed", embedding_dimension=dimension)  # fmt: skip
    engine = OpenAISiteConfig(base_url="http://127.0.0.1:1/v1", engine_model="minilm")
    client = OpenAISiteClient("s", "minilm", engine, tokenizers, 1.0, task="embed")
    config = SiteConfig("s", "aws", "r", engine.base_url, "minilm", kind="openai", openai=engine)
    return SiteRegistry([SiteState(config, 1, client, True, info)])


def preparer(tokenizers: ModelTokenizers, models: tuple[str, ...] = ("minilm",),
             dimension: int = 384) -> EmbeddingPreparer:  # fmt: skip
    return EmbeddingPreparer(_registry(tokenizers, dimension), tokenizers, models, 64)


def test_the_four_input_forms(tokenizers: ModelTokenizers, minilm_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(minilm_dir))
    texts = ["Hello, World!", "[SEP] is a special token"]
    expected = tuple(tuple(ids) for ids in hf(texts)["input_ids"])
    prep = preparer(tokenizers)
    one = prep.prepare(EmbeddingRequest(model="minilm", input=texts[0]))
    assert one.params.inputs == expected[:1]
    assert one.params.inputs[0][0] == hf.cls_token_id  # special tokens added, as BERT expects
    several = prep.prepare(EmbeddingRequest(model="minilm", input=[*texts]))
    assert several.params.inputs == expected
    assert several.prompt_tokens == sum(map(len, expected))
    ids = prep.prepare(EmbeddingRequest(model="minilm", input=list(expected[0])))
    assert ids.params.inputs == expected[:1]
    lists = prep.prepare(EmbeddingRequest(model="minilm", input=[list(e) for e in expected]))
    assert lists.params.inputs == expected
    assert (lists.encoding_format, lists.params.dimensions) == ("float", None)
    assert lists.request_id.startswith("embd-")


def test_dimensions_equal_to_the_models_own_is_no_change(tokenizers: ModelTokenizers) -> None:
    prepared = preparer(tokenizers).prepare(
        EmbeddingRequest(model="minilm", input="x", dimensions=384, encoding_format="base64")
    )
    assert (prepared.params.dimensions, prepared.encoding_format) == (None, "base64")
    # Sites that do not say their length (openai ones) decide: the value goes to them.
    unknown = preparer(tokenizers, dimension=0).prepare(
        EmbeddingRequest(model="minilm", input="x", dimensions=64)
    )
    assert unknown.params.dimensions == 64


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"input": "x", "dimensions": 64}, "dimensions", "gives 384-dimensional"),
        ({"input": "x", "dimensions": 0}, "dimensions", "at least 1"),
        ({"input": "x", "encoding_format": "binary"}, "encoding_format", "must be one of"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": [[]]}, "input", "input 0 is empty"),
        ({"input": ["a", ""]}, "input", "input 1 is an empty string"),
        ({"input": ["a", 1]}, "input", "not a mix"),
        ({"input": [[1, 2], [30522]]}, "input", "input 1: token ids must be in [0, 30522)"),
        ({"input": [[101] * 257]}, "input", "maximum context length is 256 tokens"),
        ({"input": "y" * (256 * 64 + 1)}, "input", "reads at most 256 tokens"),
        ({"input": ["z"] * 2049}, "input", "at most 2048 inputs"),
    ],
)
def test_bad_requests_name_their_parameter(
    tokenizers: ModelTokenizers, fields: dict[str, object], param: str, says: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        preparer(tokenizers).prepare(EmbeddingRequest(model="minilm", **fields))  # type: ignore[arg-type]
    assert refused.value.param == param
    assert says in refused.value.message


def test_a_model_that_is_not_an_embedding_model_is_not_found(tokenizers: ModelTokenizers) -> None:
    with pytest.raises(NotFound) as other:
        preparer(tokenizers).prepare(EmbeddingRequest(model="tiny", input="x"))
    assert other.value.code == "model_not_found"
    assert "no site serves an embedding model named 'tiny'; embedding models here: minilm" in (
        other.value.message
    )
    with pytest.raises(NotFound) as none:
        preparer(tokenizers, models=()).prepare(EmbeddingRequest(model="minilm", input="x"))
    assert "no embedding model is configured on this gateway" in none.value.message


def test_the_openai_site_wire_sends_token_ids_and_reads_both_encodings() -> None:
    params = EmbedParams("r", ((101, 7, 102), (101, 102)), dimensions=8)
    assert embedding_body(params, "engine-m") == {
        "model": "engine-m", "input": [[101, 7, 102], [101, 102]],
        "encoding_format": "float", "dimensions": 8}  # fmt: skip
    packed = struct.pack("<2f", 0.5, -1.0)
    answer = {"data": [{"index": 1, "embedding": base64.b64encode(packed).decode()},
                       {"index": 0, "embedding": [0.25, 2.0]}]}  # fmt: skip
    assert parse_embeddings(answer, 2) == (struct.pack("<2f", 0.25, 2.0), packed)
    malformed: object
    for malformed in ({"data": []}, {"data": [{"index": 0, "embedding": "%%"}] * 2},
                      {"data": [{"index": 0, "embedding": [1.0]}] * 2}, "text"):  # fmt: skip
        with pytest.raises(MalformedStream):
            parse_embeddings(malformed, 2)
