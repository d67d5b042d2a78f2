from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.sites.config import FederationConfigError, load_federation, parse_federation

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
