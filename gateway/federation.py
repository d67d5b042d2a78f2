"""The federation file: which models the gateway serves and which sites serve them.

    {
      "models": [{"name": "tiny-llama", "tokenizer": "var/models/tiny-llama",
                  "chat_template": "templates/tiny.jinja",
                  "predictor": "var/predictor/tiny-llama"}],
      "sites": [{"name": "aws-use1-a", "cloud": "aws", "region": "us-east-1",
                 "endpoint": "10.0.0.5:50051", "model": "tiny-llama", "capacity_weight": 1.0}]
    }

A model's `share_prefix_cache` (default false) lets its sites share cached prompt blocks across
API keys, which a common system prompt gains from, at a cost: a tenant's time to first token then
tells whether a prefix was sent by another (gateway/completions/cache_salt.py).
`chat_template` (a Jinja file) is optional: gateway/chat/templates.py says what is used without
it. `parse_special_tokens_in_messages` (default false) lets the text of a special token in a chat
message be that control token, as before issue 32 (a client can then write turns of any role):
only for deployments whose clients are trusted with the prompt format. `predictor` (optional)
is the model's own length-predictor artifact, trained on that model's answers; a model without
one is predicted by the gateway's default (GATEWAY_PREDICTOR_DIR), and a version the registry
activates for the model replaces either (gateway/prediction/lifecycle.py). A site's optional
`tls_server_name` is the name its TLS certificate carries when the endpoint's host is not it
(docs/security.md). Relative paths are resolved against the file's folder. Terraform renders
this file for real deployments (infra/terraform), so it is plain JSON.

A model's `task` is `generate` (the default: /v1/completions, /v1/chat/completions) or `embed`:
an embedding model (all-MiniLM-L6-v2 and the like), served at /v1/embeddings only, whose sites
embed their inputs instead of generating (docs/openai-api.md, "Embeddings"). An embedding model
takes none of the generation fields (chat_template, predictor, share_prefix_cache,
tool_call_format, parse_special_tokens_in_messages); its sites are of either kind:

    {"name": "minilm", "tokenizer": "models/all-MiniLM-L6-v2", "task": "embed"}

A site's `kind` is `grpc` (the default: this project's site engine at `endpoint`) or `openai`
(any OpenAI-compatible server: vLLM, SGLang, TGI, or our engine's HTTP face), which names
`base_url` instead of `endpoint` (docs/external-engines.md):

    {"name": "vllm-use1", "cloud": "aws", "region": "us-east-1", "model": "tiny-llama",
     "kind": "openai", "base_url": "http://10.0.0.9:8000/v1", "engine_model": "meta/llama",
     "api_key_file": "secrets/vllm.key", "metrics_url": "http://10.0.0.9:8000/metrics",
     "metrics_dialect": "vllm", "max_model_len": 8192, "max_num_seqs": 256,
     "kv_events_endpoint": "tcp://10.0.0.9:5557", "kv_events_replay_endpoint":
     "tcp://10.0.0.9:5558", "kv_block_size": 16}

Its tokens are counted with its model's tokenizer (one model, one tokenizer: predictions and
continuations across sites of both kinds count the same tokens).

`adapters` (optional) says who owns a LoRA adapter the sites serve: gateway/federation_adapters.py.

`routing_profiles` (optional) defines routing profiles beyond the built-in ones (filters, weighted
scorers, a picker, by their registered names: gateway/routing/catalogue.py); GATEWAY_ROUTING_POLICY
picks one by name. A part is a name or {"name", "params", "weight" (scorers)}:

    "routing_profiles": [{"name": "sticky_cost",
      "filters": ["serves_model", "healthy", "fits_context", "not_draining", "queue_bound",
                  "kv_room", {"name": "hot_spot_guard", "params": {"ratio": 3.0}}],
      "scorers": [{"name": "completion_cost"}, {"name": "session_affinity", "weight": 0.5}],
      "picker": "max_score"}]
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from gateway.federation_adapters import AdapterConfig, AdapterEntry, check_adapters
from gateway.routing.catalogue import BUILT_IN, build_profile
from gateway.routing.profile_settings import ParamValue, PartSettings, ProfileSettings

_NAME = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
_ENDPOINT = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")
_URL = re.compile(r"^https?://[^\s/?#]+(/[^\s?#]*)?$")
_ZMQ_URL = re.compile(r"^tcp://[A-Za-z0-9.\-\[\]:*]+:\d{1,5}$")
SiteKind = Literal["grpc", "openai"]
ModelTask = Literal["generate", "embed"]
MetricsDialect = Literal["vllm", "sglang", "tgi", "none"]
StructuredDialect = Literal["vllm", "sglang", "none"]
_DNS_NAME = Annotated[
    str, msgspec.Meta(pattern=r"^[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9-]{1,63})*$")
]


class FederationConfigError(ValueError):
    """The federation file is unreadable or inconsistent; the message says where."""


class ToolCallFormat(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a model writes a tool call: each call a JSON object {"name", "arguments"} between
    `begin` and `end`. The default is Hermes' (NousResearch), which Qwen2.5 and many fine-tunes
    use and small instruct models follow when their system prompt shows it."""

    begin: Annotated[str, msgspec.Meta(min_length=1)] = "<tool_call>\n"
    end: Annotated[str, msgspec.Meta(min_length=1)] = "\n</tool_call>"


class _ModelEntry(msgspec.Struct, forbid_unknown_fields=True):
    name: _NAME
    tokenizer: str
    # A Jinja chat-template file; absent: the tokenizer's own template, else ChatML.
    chat_template: str | None = None
    # The model's own length-predictor artifact (a directory); absent: the gateway's default.
    predictor: str | None = None
    # Its sites share cached prompt blocks across API keys (gateway/completions/cache_salt.py).
    share_prefix_cache: bool = False
    # How the model writes tool calls; absent: Hermes-style JSON in <tool_call> tags.
    tool_call_format: ToolCallFormat | None = None
    # true: the text of a special token in a chat message is that control token (a client can
    # write turns of any role); false (default): it is text (gateway/chat/templates.py).
    parse_special_tokens_in_messages: bool = False
    # generate (default) or embed: an embedding model, served at /v1/embeddings only.
    task: ModelTask = "generate"


_POSITIVE = Annotated[int, msgspec.Meta(ge=1)]


class _SiteEntry(msgspec.Struct, forbid_unknown_fields=True):
    name: _NAME
    cloud: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
    region: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    model: str
    kind: SiteKind = "grpc"
    # grpc: host:port of the site engine.
    endpoint: str | None = None
    capacity_weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    # Prompt tokens the site computes per second, as the operator measured it (the cost model's
    # prefill rate; llm-d's prefix-cache-affinity filter takes the same figure per deployment).
    prefill_tokens_per_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    # With mutual TLS: the name the site's certificate must carry, when not the endpoint's host.
    tls_server_name: _DNS_NAME | None = None
    # openai: the server's API root (ending in /v1), the model's name there (default: the
    # gateway's), a file holding its API key, where its Prometheus metrics are and whose names
    # they carry, and what /v1/models and the metrics may not say (context, batch slots, KV).
    base_url: str | None = None
    engine_model: str | None = None
    api_key_file: str | None = None
    metrics_url: str | None = None
    metrics_dialect: MetricsDialect = "none"
    metrics_interval_ms: Annotated[int, msgspec.Meta(ge=100)] = 1000
    max_model_len: _POSITIVE | None = None
    max_num_seqs: _POSITIVE | None = None
    kv_capacity_tokens: _POSITIVE | None = None
    # Ask for the answer's token ids (vLLM's `return_token_ids`, our engine's HTTP face) so a
    # continuation elsewhere resumes from the exact tokens; off: the text is re-tokenized.
    request_token_ids: bool = True
    # vLLM's KV cache events (its --kv-events-config: publisher endpoint, replay endpoint and
    # topic) and its --block-size: the site's prefix index follows them (else it is the
    # gateway's own routing history).
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_block_size: _POSITIVE = 16
    structured_outputs: StructuredDialect = "vllm"
    dynamic_lora: bool = False


class _PartEntry(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    params: dict[str, ParamValue] = msgspec.field(default_factory=dict)
    weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0

    def settings(self) -> PartSettings:
        return PartSettings(self.name, tuple(sorted(self.params.items())), self.weight)


_Part = str | _PartEntry


class _ProfileEntry(msgspec.Struct, forbid_unknown_fields=True):
    name: _NAME
    filters: list[_Part]
    scorers: list[_Part] = msgspec.field(default_factory=list)
    picker: _Part = "max_score"


class _FederationFile(msgspec.Struct, forbid_unknown_fields=True):
    models: list[_ModelEntry]
    sites: list[_SiteEntry]
    routing_profiles: list[_ProfileEntry] = msgspec.field(default_factory=list)
    adapters: list[AdapterEntry] = msgspec.field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    tokenizer: Path
    chat_template: Path | None = None
    predictor: Path | None = None
    share_prefix_cache: bool = False
    tool_call_format: ToolCallFormat = dataclasses.field(default_factory=ToolCallFormat)
    parse_special_tokens_in_messages: bool = False
    task: ModelTask = "generate"


@dataclass(frozen=True, slots=True)
class OpenAISiteConfig:
    """How the gateway reaches an OpenAI-compatible engine (a site of kind `openai`)."""

    base_url: str
    engine_model: str
    api_key_file: Path | None = None
    metrics_url: str | None = None
    metrics_dialect: MetricsDialect = "none"
    metrics_interval_ms: int = 1000
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    kv_capacity_tokens: int | None = None
    request_token_ids: bool = True
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_block_size: int = 16
    # How the engine takes a JSON schema on /v1/completions: "vllm" (structured_outputs,
    # vLLM >= 0.10.2 and this project's own HTTP face), "sglang" (json_schema), or "none"
    # (constrained requests are not sent to it).
    structured_outputs: StructuredDialect = "vllm"
    # The operator may load and unload LoRA adapters on it at run time through vLLM's
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM started with
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); off: the admin API says the site cannot.
    dynamic_lora: bool = False


@dataclass(frozen=True, slots=True)
class SiteConfig:
    name: str
    cloud: str
    region: str
    # grpc: host:port; openai: the base URL (what the sites table records either way).
    endpoint: str
    model: str
    capacity_weight: float = 1.0
    tls_server_name: str | None = None
    kind: SiteKind = "grpc"
    openai: OpenAISiteConfig | None = None
    prefill_tokens_per_s: float | None = None


@dataclass(frozen=True, slots=True)
class FederationConfig:
    models: tuple[ModelConfig, ...]
    sites: tuple[SiteConfig, ...]
    routing_profiles: tuple[ProfileSettings, ...] = ()
    # LoRA adapters the operator says something of (gateway/federation_adapters.py).
    adapters: tuple[AdapterConfig, ...] = ()

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    @property
    def generative_models(self) -> tuple[ModelConfig, ...]:
        return tuple(m for m in self.models if m.task == "generate")

    @property
    def embedding_models(self) -> tuple[ModelConfig, ...]:
        return tuple(m for m in self.models if m.task == "embed")


def parse_federation(data: bytes, base_dir: Path) -> FederationConfig:
    try:
        raw = msgspec.json.decode(data, type=_FederationFile)
    except msgspec.DecodeError as exc:
        raise FederationConfigError(f"invalid federation file: {exc}") from exc
    models = tuple(_model(m, base_dir) for m in raw.models)
    sites = tuple(_site(s, base_dir) for s in raw.sites)
    _check(models, sites)
    try:
        adapters = check_adapters(
            raw.adapters,
            (m.name for m in models if m.task == "generate"),
            (m.name for m in models),
        )
    except ValueError as exc:
        raise FederationConfigError(str(exc)) from exc
    return FederationConfig(models, sites, _profiles(raw.routing_profiles), adapters)


# What only a generative model takes, with the value that means "not set".
_GENERATION_FIELDS = {
    "chat_template": None,
    "predictor": None,
    "share_prefix_cache": False,
    "tool_call_format": None,
    "parse_special_tokens_in_messages": False,
}


def _model(entry: _ModelEntry, base_dir: Path) -> ModelConfig:
    if entry.task == "embed":
        given = sorted(k for k, unset in _GENERATION_FIELDS.items() if getattr(entry, k) != unset)
        if given:
            raise FederationConfigError(
                f"model {entry.name!r} is an embedding model (task embed): it takes none of the "
                f"generation fields, got {given}"
            )
    return ModelConfig(
        entry.name,
        (base_dir / entry.tokenizer).resolve(),
        None if entry.chat_template is None else (base_dir / entry.chat_template).resolve(),
        None if entry.predictor is None else (base_dir / entry.predictor).resolve(),
        entry.share_prefix_cache,
        entry.tool_call_format or ToolCallFormat(),
        entry.parse_special_tokens_in_messages,
        entry.task,
    )


def _part(entry: _Part) -> PartSettings:
    return PartSettings(entry) if isinstance(entry, str) else entry.settings()


def _profiles(entries: list[_ProfileEntry]) -> tuple[ProfileSettings, ...]:
    profiles = tuple(
        ProfileSettings(
            entry.name,
            tuple(_part(f) for f in entry.filters),
            tuple(_part(s) for s in entry.scorers),
            _part(entry.picker),
        )
        for entry in entries
    )
    names = [profile.name for profile in profiles]
    taken = sorted({n for n in names if names.count(n) > 1 or n in BUILT_IN})
    if taken:
        raise FederationConfigError(
            f"routing profile names must be new and unique: {taken} (built-in: {sorted(BUILT_IN)})"
        )
    for profile in profiles:
        try:
            build_profile(profile)  # every part and parameter is checked now, not at a request
        except ValueError as exc:
            raise FederationConfigError(str(exc)) from exc
    return profiles


def _site(entry: _SiteEntry, base_dir: Path) -> SiteConfig:
    if entry.kind == "grpc":
        openai_fields = [
            name
            for name in (
                "base_url",
                "engine_model",
                "api_key_file",
                "metrics_url",
                "kv_events_endpoint",
                "kv_events_replay_endpoint",
            )
            if getattr(entry, name) is not None
        ]
        if entry.endpoint is None or openai_fields:
            raise FederationConfigError(
                f"site {entry.name!r} (kind grpc) needs 'endpoint' and takes none of the openai "
                f"fields, got endpoint={entry.endpoint!r} and {openai_fields}"
            )
        return SiteConfig(
            entry.name, entry.cloud, entry.region, entry.endpoint, entry.model,
            entry.capacity_weight, entry.tls_server_name,
            prefill_tokens_per_s=entry.prefill_tokens_per_s,
        )  # fmt: skip
    openai = _openai_site(entry, base_dir)
    return SiteConfig(
        entry.name,
        entry.cloud,
        entry.region,
        openai.base_url,
        entry.model,
        entry.capacity_weight,
        kind="openai",
        openai=openai,
        prefill_tokens_per_s=entry.prefill_tokens_per_s,
    )


def _openai_site(entry: _SiteEntry, base_dir: Path) -> OpenAISiteConfig:
    where = f"site {entry.name!r} (kind openai)"
    if entry.endpoint is not None or entry.tls_server_name is not None:
        raise FederationConfigError(f"{where} takes 'base_url', not 'endpoint'/'tls_server_name'")
    for field, url in (("base_url", entry.base_url), ("metrics_url", entry.metrics_url)):
        if (url is not None or field == "base_url") and not _URL.match(url or ""):
            raise FederationConfigError(f"{where}: {field} must be an http(s) URL, got {url!r}")
    for field, zmq_url in (
        ("kv_events_endpoint", entry.kv_events_endpoint),
        ("kv_events_replay_endpoint", entry.kv_events_replay_endpoint),
    ):
        if zmq_url is not None and not _ZMQ_URL.match(zmq_url):
            raise FederationConfigError(
                f"{where}: {field} must be tcp://host:port, got {zmq_url!r}"
            )
    if entry.kv_events_replay_endpoint is not None and entry.kv_events_endpoint is None:
        raise FederationConfigError(f"{where}: kv_events_replay_endpoint needs kv_events_endpoint")
    if (entry.metrics_url is None) != (entry.metrics_dialect == "none"):
        raise FederationConfigError(
            f"{where}: 'metrics_url' and a 'metrics_dialect' (vllm, sglang, tgi) go together"
        )
    return OpenAISiteConfig(
        base_url=(entry.base_url or "").rstrip("/"),
        engine_model=entry.engine_model or entry.model,
        api_key_file=None
        if entry.api_key_file is None
        else (base_dir / entry.api_key_file).resolve(),
        metrics_url=entry.metrics_url,
        metrics_dialect=entry.metrics_dialect,
        metrics_interval_ms=entry.metrics_interval_ms,
        max_model_len=entry.max_model_len,
        max_num_seqs=entry.max_num_seqs,
        kv_capacity_tokens=entry.kv_capacity_tokens,
        request_token_ids=entry.request_token_ids,
        kv_events_endpoint=entry.kv_events_endpoint,
        kv_events_replay_endpoint=entry.kv_events_replay_endpoint,
        kv_events_topic=entry.kv_events_topic,
        kv_block_size=entry.kv_block_size,
        structured_outputs=entry.structured_outputs,
        dynamic_lora=entry.dynamic_lora,
    )


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
        if site.kind == "grpc" and not _ENDPOINT.match(site.endpoint):
            raise FederationConfigError(
                f"site {site.name!r}: endpoint must be host:port, got {site.endpoint!r}"
            )


def parse_site(data: bytes, base_dir: Path, models: tuple[ModelConfig, ...]) -> SiteConfig:
    """One site entry as the federation file writes it (a site joining at run time: the admin
    API, gateway/admin/membership.py), checked as the file's sites are."""
    try:
        entry = msgspec.json.decode(data, type=_SiteEntry)
    except msgspec.DecodeError as exc:
        raise FederationConfigError(f"invalid site: {exc}") from exc
    site = _site(entry, base_dir)
    _check(models, (site,))
    return site


def load_federation(path: Path) -> FederationConfig:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FederationConfigError(f"cannot read federation file {path}: {exc}") from exc
    return parse_federation(data, path.resolve().parent)
