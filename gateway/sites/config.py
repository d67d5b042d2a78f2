"""The federation file: which models the gateway serves and which sites serve them.

    {
      "models": [{"name": "tiny-llama", "tokenizer": "var/models/tiny-llama",
                  "chat_template": "templates/tiny.jinja",
                  "predictor": "var/predictor/tiny-llama"}],
      "sites": [{"name": "aws-use1-a", "cloud": "aws", "region": "us-east-1",
                 "endpoint": "10.0.0.5:50051", "model": "tiny-llama", "capacity_weight": 1.0}]
    }

`chat_template` (a Jinja file) is optional: gateway/chat_templates.py says what is used without
it. `predictor` (optional) is the model's own length-predictor artifact, trained on that model's
answers; a model without one is predicted by the gateway's default (GATEWAY_PREDICTOR_DIR), and
a version the registry activates for the model replaces either (gateway/predictor_lifecycle.py).
A site's optional `tls_server_name` is the name its TLS certificate carries when the endpoint's
host is not it (docs/security.md). Relative paths are resolved against the file's
folder. Terraform renders this file for real deployments (infra/terraform), so it is plain JSON.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

_NAME = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
_ENDPOINT = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")
_DNS_NAME = Annotated[
    str, msgspec.Meta(pattern=r"^[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9-]{1,63})*$")
]


class FederationConfigError(ValueError):
    """The federation file is unreadable or inconsistent; the message says where."""


class _ModelEntry(msgspec.Struct, forbid_unknown_fields=True):
    name: _NAME
    tokenizer: str
    # A Jinja chat-template file; absent: the tokenizer's own template, else ChatML.
    chat_template: str | None = None
    # The model's own length-predictor artifact (a directory); absent: the gateway's default.
    predictor: str | None = None


class _SiteEntry(msgspec.Struct, forbid_unknown_fields=True):
    name: _NAME
    cloud: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
    region: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    endpoint: str
    model: str
    capacity_weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    # With mutual TLS: the name the site's certificate must carry, when not the endpoint's host.
    tls_server_name: _DNS_NAME | None = None


class _FederationFile(msgspec.Struct, forbid_unknown_fields=True):
    models: list[_ModelEntry]
    sites: list[_SiteEntry]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    tokenizer: Path
    chat_template: Path | None = None
    predictor: Path | None = None


@dataclass(frozen=True, slots=True)
class SiteConfig:
    name: str
    cloud: str
    region: str
    endpoint: str
    model: str
    capacity_weight: float = 1.0
    tls_server_name: str | None = None


@dataclass(frozen=True, slots=True)
class FederationConfig:
    models: tuple[ModelConfig, ...]
    sites: tuple[SiteConfig, ...]

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)


def parse_federation(data: bytes, base_dir: Path) -> FederationConfig:
    try:
        raw = msgspec.json.decode(data, type=_FederationFile)
    except msgspec.DecodeError as exc:
        raise FederationConfigError(f"invalid federation file: {exc}") from exc
    models = tuple(
        ModelConfig(
            m.name,
            (base_dir / m.tokenizer).resolve(),
            None if m.chat_template is None else (base_dir / m.chat_template).resolve(),
            None if m.predictor is None else (base_dir / m.predictor).resolve(),
        )
        for m in raw.models
    )
    sites = tuple(
        SiteConfig(
            s.name, s.cloud, s.region, s.endpoint, s.model, s.capacity_weight, s.tls_server_name
        )
        for s in raw.sites
    )
    _check(models, sites)
    return FederationConfig(models, sites)


def _check(models: tuple[ModelConfig, ...], sites: tuple[SiteConfig, ...]) -> None:
    if not models or not sites:
        raise FederationConfigError("the federation file needs at least one model and one site")
    model_names = [m.name for m in models]
    for kind, names in (("model", model_names), ("site", [s.name for s in sites])):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise FederationConfigError(f"duplicate {kind} names: {duplicates}")
    for site in sites:
        if site.model not in model_names:
            raise FederationConfigError(
                f"site {site.name!r} serves model {site.model!r}, which is not in 'models'"
            )
        if not _ENDPOINT.match(site.endpoint):
            raise FederationConfigError(
                f"site {site.name!r}: endpoint must be host:port, got {site.endpoint!r}"
            )


def load_federation(path: Path) -> FederationConfig:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FederationConfigError(f"cannot read federation file {path}: {exc}") from exc
    return parse_federation(data, path.resolve().parent)
