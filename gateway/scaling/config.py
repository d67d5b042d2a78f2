"""The scaling file (GATEWAY_SCALING_FILE): which models follow their load, within which bounds,
and what starts and stops their sites. docs/elastic.md describes every field.

    {"interval_s": 1.0,
     "models": [{"model": "fed", "min_sites": 1, "max_sites": 2, "target_backlog_s": 2.0,
                 "lead_time_s": 45, "in_window_s": 60,
                 "actuator": {"kind": "local",
                              "command": [".venv/bin/python", "-m", "site_engine",
                                          "--model", "var/models/fed", "--model-name", "fed"],
                              "slots": [{"env": {"CUDA_VISIBLE_DEVICES": "1"},
                                         "args": ["--device", "cuda"]}]}}]}

Actuator kinds: `local` starts and stops site-engine processes on this machine, one per slot
(a GPU, or CPU threads); `kubernetes` follows the pods a StatefulSet runs (KEDA or the HPA scale
it on the metric this gateway exports) through their DNS names; `signal` only exports the
desired number of sites (fedllm_gateway_scaling_desired_sites) for an autoscaler that
registers sites by other means. A relative `log_dir` is resolved against the file's folder; the
local command runs in the gateway's working directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from gateway.scaling.policy import ScalingRule

_POSITIVE = Annotated[float, msgspec.Meta(gt=0)]
_NAME = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")]


class ScalingConfigError(ValueError):
    """The scaling file is unreadable or inconsistent; the message says where."""


class _Slot(msgspec.Struct, forbid_unknown_fields=True):
    env: dict[str, str] = msgspec.field(default_factory=dict)
    args: list[str] = msgspec.field(default_factory=list)


class _Actuator(msgspec.Struct, forbid_unknown_fields=True):
    kind: Literal["local", "kubernetes", "signal"]
    # Where the sites it brings are placed (the sites table and the dashboard's clouds).
    cloud: str = "local"
    region: str = "local"
    capacity_weight: _POSITIVE = 1.0
    prefill_tokens_per_s: _POSITIVE | None = None
    # Its sites are named <name_prefix>-<slot or ordinal> (default: <model>-elastic).
    name_prefix: _NAME | None = None
    # A start that does not serve within this long has failed.
    start_timeout_s: _POSITIVE = 600.0
    # local: the site engine's command line (the actuator adds --port, --site-name and the
    # slot's args), where each slot's site runs, the host it listens on, where its log goes.
    command: list[str] = msgspec.field(default_factory=list)
    slots: list[_Slot] = msgspec.field(default_factory=list)
    host: str = "127.0.0.1"
    log_dir: str = "elastic-sites"
    stop_timeout_s: _POSITIVE = 30.0
    # Started sites kept waiting for a scale-out (local: pooled site-engine processes, no GPU;
    # kubernetes: started pods beyond the desired sites, each holding its GPU, resolved but not
    # joined until a scale-out wants their ordinal). docs/elastic.md, "The warm pool".
    pool_size: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    # kubernetes: the pods' DNS names, `{i}` the StatefulSet ordinal, and their gRPC port.
    host_pattern: str | None = None
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 50051
    tls_server_name: str | None = None
    resolve_every_s: _POSITIVE = 5.0
    # local: a scale-out marked idle-memory-first (the rule's short_peak_s) starts its site in
    # the free top of a running site's KV cache, beside it on its GPU, with a KV cache of this
    # many MiB (0: never; every start takes a free slot). docs/elastic.md, "Idle memory first".
    idle_memory_kv_mib: Annotated[int, msgspec.Meta(ge=0)] = 0
    # local: what such a site needs beside its KV cache (weights, activations, CUDA graphs), in
    # MiB: borrowed from the lender too, so that the site fits in memory its lender gave back.
    idle_memory_overhead_mib: Annotated[int, msgspec.Meta(ge=0)] = 0


class _Model(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    actuator: _Actuator
    min_sites: Annotated[int, msgspec.Meta(ge=0)] = 1
    max_sites: Annotated[int, msgspec.Meta(ge=1)] = 2
    target_backlog_s: _POSITIVE = 2.0
    scale_out_at: _POSITIVE = 1.0
    scale_in_below: _POSITIVE = 0.4
    lead_time_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    rate_s: _POSITIVE = 5.0
    settle_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    in_window_s: _POSITIVE = 60.0
    in_headroom: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.2
    out_after_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    in_after_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    out_cooldown_s: Annotated[float, msgspec.Meta(ge=0)] = 15.0
    in_cooldown_s: Annotated[float, msgspec.Meta(ge=0)] = 120.0
    site_tokens_per_s: _POSITIVE = 1000.0
    site_prefill_tokens_per_s: _POSITIVE = 10000.0
    short_peak_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class _File(msgspec.Struct, forbid_unknown_fields=True):
    models: list[_Model]
    interval_s: _POSITIVE = 1.0
    # How long a leaving site may take to finish its work before it goes anyway.
    drain_timeout_s: _POSITIVE = 600.0


@dataclass(frozen=True, slots=True)
class LocalSlot:
    env: tuple[tuple[str, str], ...] = ()
    args: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ActuatorConfig:
    kind: str
    name_prefix: str
    cloud: str = "local"
    region: str = "local"
    capacity_weight: float = 1.0
    prefill_tokens_per_s: float | None = None
    start_timeout_s: float = 600.0
    command: tuple[str, ...] = ()
    slots: tuple[LocalSlot, ...] = ()
    host: str = "127.0.0.1"
    log_dir: Path = Path("elastic-sites")
    stop_timeout_s: float = 30.0
    pool_size: int = 0
    host_pattern: str | None = None
    port: int = 50051
    tls_server_name: str | None = None
    resolve_every_s: float = 5.0
    idle_memory_kv_mib: int = 0
    idle_memory_overhead_mib: int = 0


@dataclass(frozen=True, slots=True)
class ModelScaling:
    rule: ScalingRule
    actuator: ActuatorConfig


@dataclass(frozen=True, slots=True)
class ScalingConfig:
    models: tuple[ModelScaling, ...] = ()
    interval_s: float = 1.0
    drain_timeout_s: float = 600.0
    rules: dict[str, ScalingRule] = field(default_factory=dict)


def parse_scaling(data: bytes, base_dir: Path, served: frozenset[str]) -> ScalingConfig:
    try:
        raw = msgspec.json.decode(data, type=_File)
    except msgspec.DecodeError as exc:
        raise ScalingConfigError(f"invalid scaling file: {exc}") from exc
    names = [m.model for m in raw.models]
    if len(set(names)) != len(names):
        raise ScalingConfigError(f"a model is named twice in the scaling file: {names}")
    models = tuple(_model(entry, base_dir, served) for entry in raw.models)
    return ScalingConfig(
        models, raw.interval_s, raw.drain_timeout_s, {m.rule.model: m.rule for m in models}
    )


def _model(entry: _Model, base_dir: Path, served: frozenset[str]) -> ModelScaling:
    where = f"scaling file, model {entry.model!r}"
    if entry.model not in served:
        raise ScalingConfigError(f"{where}: not a model of the federation file {sorted(served)}")
    fields = {f: getattr(entry, f) for f in ScalingRule.__dataclass_fields__ if f != "model"}
    try:
        rule = ScalingRule(entry.model, **fields)
    except ValueError as exc:
        raise ScalingConfigError(f"{where}: {exc}") from exc
    return ModelScaling(rule, _actuator(entry.actuator, entry.model, base_dir, where))


def _actuator(raw: _Actuator, model: str, base_dir: Path, where: str) -> ActuatorConfig:
    if raw.kind == "local" and (not raw.command or not raw.slots):
        raise ScalingConfigError(f"{where}: a local actuator needs 'command' and 'slots'")
    if raw.kind == "kubernetes" and (raw.host_pattern is None or "{i}" not in raw.host_pattern):
        raise ScalingConfigError(
            f"{where}: a kubernetes actuator needs 'host_pattern' with {{i}} (the pod ordinal)"
        )
    if raw.kind == "signal" and raw.pool_size:
        raise ScalingConfigError(
            f"{where}: a signal actuator has no pool (pool_size is for local or kubernetes)"
        )
    if raw.kind != "local" and (raw.idle_memory_kv_mib or raw.idle_memory_overhead_mib):
        raise ScalingConfigError(
            f"{where}: idle_memory_kv_mib and idle_memory_overhead_mib are for a local actuator "
            "(it starts sites beside others)"
        )
    if raw.idle_memory_overhead_mib and not raw.idle_memory_kv_mib:
        raise ScalingConfigError(
            f"{where}: idle_memory_overhead_mib without idle_memory_kv_mib: no site starts in "
            "idle memory"
        )
    log_dir = Path(raw.log_dir)
    return ActuatorConfig(
        kind=raw.kind,
        name_prefix=raw.name_prefix or f"{model}-elastic",
        cloud=raw.cloud,
        region=raw.region,
        capacity_weight=raw.capacity_weight,
        prefill_tokens_per_s=raw.prefill_tokens_per_s,
        start_timeout_s=raw.start_timeout_s,
        command=tuple(raw.command),
        slots=tuple(LocalSlot(tuple(sorted(s.env.items())), tuple(s.args)) for s in raw.slots),
        host=raw.host,
        log_dir=log_dir if log_dir.is_absolute() else (base_dir / log_dir).resolve(),
        stop_timeout_s=raw.stop_timeout_s,
        pool_size=raw.pool_size,
        host_pattern=raw.host_pattern,
        port=raw.port,
        tls_server_name=raw.tls_server_name,
        resolve_every_s=raw.resolve_every_s,
        idle_memory_kv_mib=raw.idle_memory_kv_mib,
        idle_memory_overhead_mib=raw.idle_memory_overhead_mib,
    )


def load_scaling(path: Path, served: frozenset[str]) -> ScalingConfig:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ScalingConfigError(f"cannot read scaling file {path}: {exc}") from exc
    return parse_scaling(data, path.resolve().parent, served)
