from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.federation import FederationConfigError, load_federation, parse_federation

GOOD = {
    "models": [{"name": "m", "tokenizer": "tok"}],
    "sites": [
        {
            "name": "a",
            "cloud": "aws",
            "region": "us-east-1",
            "endpoint": "10.0.0.1:50051",
            "model": "m",
        },
        {
            "name": "b",
            "cloud": "gcp",
            "region": "eu",
            "endpoint": "[::1]:50051",
            "model": "m",
            "capacity_weight": 2.0,
        },
    ],
}


def variant(**changes: object) -> bytes:
    data = json.loads(json.dumps(GOOD))
    for path, value in changes.items():
        section, index, key = path.split("__")
        data[section][int(index)][key] = value
    return json.dumps(data).encode()


def test_good_file_resolves_tokenizer_relative_to_the_file(tmp_path: Path) -> None:
    config = parse_federation(json.dumps(GOOD).encode(), tmp_path)
    model = config.model("m")
    assert model is not None
    assert model.tokenizer == (tmp_path / "tok").resolve()
    assert [s.capacity_weight for s in config.sites] == [1.0, 2.0]
    assert model.predictor is None


def test_a_model_predictor_resolves_relative_to_the_file(tmp_path: Path) -> None:
    config = parse_federation(variant(models__0__predictor="../pred/m"), tmp_path / "conf")
    model = config.model("m")
    assert model is not None
    assert model.predictor == (tmp_path / "pred" / "m").resolve()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"{", "invalid federation file"),
        (variant(sites__1__name="a"), "duplicate site names"),
        (variant(sites__0__model="nope"), "not in 'models'"),
        (variant(sites__0__endpoint="no-port"), "endpoint must be host:port"),
        (variant(sites__0__capacity_weight=0), "capacity_weight"),
        (variant(sites__0__name="bad name!"), "name"),
        (variant(sites__0__zone="x"), "unknown field"),
        (json.dumps({"models": [], "sites": []}).encode(), "at least one model"),
    ],
)
def test_bad_files_are_refused_with_a_reason(data: bytes, message: str, tmp_path: Path) -> None:
    with pytest.raises(FederationConfigError, match=message):
        parse_federation(data, tmp_path)


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FederationConfigError, match="cannot read federation file"):
        load_federation(tmp_path / "absent.json")


OPENAI_SITE: dict[str, object] = {
    "name": "ext",
    "cloud": "aws",
    "region": "us-west-2",
    "model": "m",
    "kind": "openai",
    "base_url": "http://10.0.0.9:8000/v1/",
    "engine_model": "org/model",
    "api_key_file": "secrets/key",
    "metrics_url": "http://10.0.0.9:8000/metrics",
    "metrics_dialect": "vllm",
}


def with_site(site: dict[str, object]) -> bytes:
    data = json.loads(json.dumps(GOOD))
    data["sites"].append(site)
    return json.dumps(data).encode()


def test_an_openai_site_resolves_its_key_file_and_keeps_its_engine_model(tmp_path: Path) -> None:
    config = parse_federation(with_site(OPENAI_SITE), tmp_path)
    site = config.sites[2]
    assert site.kind == "openai"
    assert site.openai is not None
    assert site.openai.base_url == "http://10.0.0.9:8000/v1"
    assert site.openai.engine_model == "org/model"
    assert site.openai.api_key_file == (tmp_path / "secrets" / "key").resolve()
    assert site.endpoint == site.openai.base_url  # what the sites table records
    assert config.sites[0].kind == "grpc"
    assert (site.openai.kv_events_endpoint, site.openai.kv_block_size) == (None, 16)


def test_an_openai_site_may_name_vllms_kv_events_and_its_prefill_rate(tmp_path: Path) -> None:
    events = {"kv_events_endpoint": "tcp://10.0.0.9:5557", "kv_events_topic": "kv",
              "kv_events_replay_endpoint": "tcp://10.0.0.9:5558", "kv_block_size": 32,
              "prefill_tokens_per_s": 20000.0}  # fmt: skip
    site = parse_federation(with_site({**OPENAI_SITE, **events}), tmp_path).sites[2]
    assert site.openai is not None
    assert site.prefill_tokens_per_s == 20000.0
    assert (site.openai.kv_events_endpoint, site.openai.kv_events_replay_endpoint) == (
        "tcp://10.0.0.9:5557",
        "tcp://10.0.0.9:5558",
    )
    assert (site.openai.kv_events_topic, site.openai.kv_block_size) == ("kv", 32)
    with pytest.raises(FederationConfigError, match="takes none of the openai fields"):
        parse_federation(variant(sites__0__kv_events_endpoint="tcp://h:1"), tmp_path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"base_url": "10.0.0.9:8000"}, "base_url must be an http"),
        ({"metrics_dialect": "none"}, "go together"),
        ({"metrics_url": None}, "go together"),
        ({"endpoint": "10.0.0.9:50051"}, "takes 'base_url'"),
        ({"metrics_dialect": "triton"}, "invalid federation file"),
        ({"kind": "grpc"}, "needs 'endpoint'"),
        ({"kv_events_endpoint": "10.0.0.9:5557"}, "kv_events_endpoint must be tcp://"),
        ({"kv_events_replay_endpoint": "tcp://10.0.0.9:5558"}, "needs kv_events_endpoint"),
        ({"kv_block_size": 0}, "invalid federation file"),
        ({"prefill_tokens_per_s": 0}, "invalid federation file"),
    ],
)
def test_openai_site_mistakes_are_refused(changes: dict[str, object], message: str) -> None:
    site = {k: v for k, v in {**OPENAI_SITE, **changes}.items() if v is not None}
    with pytest.raises(FederationConfigError, match=message):
        parse_federation(with_site(site), Path("."))


def test_tool_call_format_and_structured_output_dialect(tmp_path: Path) -> None:
    config = parse_federation(with_site(OPENAI_SITE), tmp_path)
    model = config.model("m")
    assert model is not None
    assert (model.tool_call_format.begin, model.tool_call_format.end) == (
        "<tool_call>\n",
        "\n</tool_call>",
    )
    assert config.sites[2].openai is not None
    assert config.sites[2].openai.structured_outputs == "vllm"
    custom = variant(models__0__tool_call_format={"begin": "<|python_tag|>", "end": "<|eom_id|>"})
    model = parse_federation(custom, tmp_path).model("m")
    assert model is not None
    assert model.tool_call_format.begin == "<|python_tag|>"
    sglang = parse_federation(with_site({**OPENAI_SITE, "structured_outputs": "sglang"}), tmp_path)
    assert sglang.sites[2].openai is not None
    assert sglang.sites[2].openai.structured_outputs == "sglang"
    with pytest.raises(FederationConfigError, match="invalid federation file"):
        parse_federation(variant(models__0__tool_call_format={"begin": ""}), tmp_path)
    with pytest.raises(FederationConfigError, match="invalid federation file"):
        parse_federation(with_site({**OPENAI_SITE, "structured_outputs": "outlines"}), tmp_path)


def test_a_model_is_generative_unless_its_task_is_embed(tmp_path: Path) -> None:
    config = parse_federation(variant(models__0__task="embed"), tmp_path)
    model = config.model("m")
    assert model is not None
    assert model.task == "embed"
    assert (config.embedding_models, config.generative_models) == ((model,), ())
    plain = parse_federation(json.dumps(GOOD).encode(), tmp_path)
    assert [m.task for m in plain.generative_models] == ["generate"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("chat_template", "t.jinja"),
        ("predictor", "pred"),
        ("share_prefix_cache", True),
        ("tool_call_format", {"begin": "<a>", "end": "</a>"}),
        ("parse_special_tokens_in_messages", True),
    ],
)
def test_an_embedding_model_takes_no_generation_field(field: str, value: object) -> None:
    with pytest.raises(FederationConfigError, match=rf"embedding model .*\['{field}'\]"):
        parse_federation(variant(models__0__task="embed", **{f"models__0__{field}": value}),
                         Path("."))  # fmt: skip


def test_an_unknown_task_is_refused() -> None:
    with pytest.raises(FederationConfigError, match="task"):
        parse_federation(variant(models__0__task="classify"), Path("."))
