"""Gateway settings: read once from GATEWAY_* environment variables and validated loudly.

Grouped by what they govern; every group is a frozen dataclass read by the shared field-driven
reader (fedllm_contract/env_settings.py). The settings table of docs/configuration.md is
generated from the fields' help (`python -m devtools.settings_table`).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from fedllm_contract.env_settings import (
    SettingsError,
    build,
    read_env,
    require_at_least,
    require_positive,
    setting,
)
from gateway.batch_settings import (
    BatchSettings,
    FileSettings,
    FineTuningSettings,
    ResponseSettings,
)
from gateway.drift_settings import DriftSettings, RetrainSettings
from gateway.federation import FederationConfigError, load_federation
from gateway.queue_settings import QueueSettings
from gateway.routing.adapter_affinity import ADAPTER_ROUTINGS, AdapterRouting
from gateway.routing.policy import POLICY_NAMES
from gateway.routing.prefix.site_prefix import DEFAULT_PREFIX_INDEX_BLOCKS
from gateway.routing.types import UNPREDICTED_PLANS, UnpredictedPlan
from gateway.security_settings import AccessSettings, AdminSettings, SiteTlsSettings

ROUTING_POLICIES = POLICY_NAMES
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

__all__ = [
    "AccessSettings",
    "AdminSettings",
    "BatchSettings",
    "FileSettings",
    "FineTuningSettings",
    "GatewaySettings",
    "QueueSettings",
    "ResponseSettings",
    "SettingsError",
    "SiteTlsSettings",
    "is_loopback",
]


@dataclass(frozen=True, slots=True)
class ServerSettings:
    ENV_PREFIX: ClassVar[str] = "GATEWAY_"

    host: str = setting("127.0.0.1", help="listen address")
    port: int = setting(8000, help="listen port")
    tokenize_threads: int = setting(
        2,
        help="threads that tokenize (and validate) completion and chat requests off the event "
        "loop; at most this many at once, the others wait",
    )
    openapi_ui: bool = setting(
        False,
        help="serve the OpenAPI UI pages (`/schema/swagger`, `/redoc`, `/elements`, `/rapidoc`), "
        "which load scripts from third-party CDNs on the admin cookie's origin; the schema "
        "itself (`/schema/openapi.json`, `.yaml`) is always served",
    )
    log_prompts: bool = setting(
        False,
        help="log each request's prompt (INFO); off, no prompt or completion is logged at any "
        "level",
    )
    log_level: str = setting(
        "INFO",
        help="`DEBUG`, `INFO`, `WARNING` or `ERROR`; API keys, the admin token and TLS keys are "
        "never logged",
    )
    workers: int = setting(
        1,
        help="gateway processes serving this address (`gateway/workers.py`): with more than one, "
        "`python -m gateway` supervises that many workers sharing the port, each a whole gateway "
        "routing on the sites' load reports; needs PostgreSQL, where key limits, idempotency and "
        "batches are shared by every process",
    )
    reuse_port: bool = setting(
        False,
        help="listen with `SO_REUSEPORT`, so several gateway processes on this host share the "
        "port and the kernel spreads connections over them (the workers do it themselves)",
    )
    batch_scheduling: bool = setting(
        True,
        help="run the gateway's threads under Linux's `SCHED_BATCH` policy (no special "
        "privilege): a thread that wakes (gRPC's completion-queue poller, after every message "
        "from a site) no longer preempts the event loop, so on a busy core the wake-ups are "
        "served in batches instead of two context switches each; elsewhere ignored",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise SettingsError(f"GATEWAY_PORT must be in 0..65535, got {self.port}")
        if self.tokenize_threads < 1:
            raise SettingsError("GATEWAY_TOKENIZE_THREADS >= 1")
        if not 1 <= self.workers <= 256:
            raise SettingsError(f"GATEWAY_WORKERS must be in 1..256, got {self.workers}")
        if self.log_level not in LOG_LEVELS:
            raise SettingsError(
                f"GATEWAY_LOG_LEVEL must be one of {LOG_LEVELS}, got {self.log_level!r}"
            )


@dataclass(frozen=True, slots=True)
class DatabaseSettings:
    ENV_PREFIX: ClassVar[str] = "GATEWAY_"

    url: str = setting(
        "sqlite+aiosqlite:///var/gateway.db",
        env="DATABASE_URL",
        help="`postgresql+psycopg://user@host/db` in production",
    )
    auto_migrate: bool = setting(True, help="run Alembic migrations at start-up")
    request_log_flush_ms: float = setting(
        20.0,
        help="the request log is written behind the requests: what they record (row, outcome, "
        "length sample) is written in one transaction for every request of this many ms (a "
        "gateway that crashes loses at most that much of its log; a database that refuses "
        "writes holds them in memory, see `GATEWAY_OUTCOME_BACKLOG_MAX`)",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.request_log_flush_ms <= 1000:
            raise SettingsError("GATEWAY_REQUEST_LOG_FLUSH_MS must be in 0..1000")
        try:
            make_url(self.url)
        except ArgumentError as exc:
            raise SettingsError(f"GATEWAY_DATABASE_URL is not a database URL: {exc}") from exc


@dataclass(frozen=True, slots=True)
class RoutingSettings:
    ENV_PREFIX: ClassVar[str] = "GATEWAY_"

    policy: str = setting(
        "completion_cost",
        env="ROUTING_POLICY",
        help="a built-in routing profile (`round_robin`, `least_requests`, `least_tokens`, "
        "`least_tokens_guess`, `mico`, `least_latency`, `completion_cost`: the lowest estimated "
        "completion time with what each site caches, `prefix_affinity`, `dynamo_cost`) or one "
        "the federation file's `routing_profiles` defines (the default `completion_cost`: "
        "docs/routing.md says why)",
    )
    plan_without_prediction: UnpredictedPlan = setting(
        "max_tokens",
        help="what routing plans for an answer it has no prediction for: `max_tokens` (safe for "
        "the KV bound), `prompt_only` (nothing: balance prompts alone) or `prompt_ratio` (1.5x "
        "the prompt, the guess of routers without a predictor)",
    )
    site_max_queued_requests: int = setting(
        256,
        help="a site whose queue reaches this many requests gets nothing new; no site left: 503 "
        "with `Retry-After` (0: no bound)",
    )
    site_max_queued_tokens: int = setting(
        0,
        help="the same bound on a site's queued prompt tokens (0: no bound)",
    )
    adapter_routing: AdapterRouting = setting(
        "affinity",
        help="how routing treats a request's LoRA adapter: `affinity` (completion_cost charges "
        "a cold adapter's load and keeps an adapter's requests where it is resident) or `blind` "
        "(every site that serves it alike); fedsim.adapter_study compares them (docs/routing.md)",
    )
    prefix_index_max_blocks: int = setting(
        DEFAULT_PREFIX_INDEX_BLOCKS,
        help="prefix-cache block ids kept per site (from its cache events, else from what this "
        "gateway sent it): ~70 bytes each (a dict entry and its 64-bit id); beyond, new ones "
        "are not recorded (events) or the least recently sent are forgotten (history)",
    )

    def __post_init__(self) -> None:
        if self.plan_without_prediction not in UNPREDICTED_PLANS:
            raise SettingsError(
                f"GATEWAY_PLAN_WITHOUT_PREDICTION must be one of {UNPREDICTED_PLANS}, "
                f"got {self.plan_without_prediction!r}"
            )
        if self.adapter_routing not in ADAPTER_ROUTINGS:
            raise SettingsError(
                f"GATEWAY_ADAPTER_ROUTING must be one of {ADAPTER_ROUTINGS}, "
                f"got {self.adapter_routing!r}"
            )
        require_at_least(self, 0, "site_max_queued_requests", "site_max_queued_tokens")
        require_at_least(self, 1, "prefix_index_max_blocks")


@dataclass(frozen=True, slots=True)
class SitesSettings:
    """How the gateway watches its sites."""

    ENV_PREFIX: ClassVar[str] = "GATEWAY_"

    health_interval_s: float = setting(2.0, help="site health/info polling period")
    connect_timeout_s: float = setting(2.0, help="deadline of health and control calls to a site")
    load_report_interval_ms: int = setting(250, help="period of the sites' pushed load reports")
    load_report_stale_s: float = setting(
        5.0,
        help="load reports silent this long are logged as stalled; the site stays routable while "
        "its health checks pass, on its last report and this gateway's own ledger",
    )
    adapter_load_timeout_s: float = setting(
        120.0,
        help="how long an admin adapter load waits for each site's answer; one that answers "
        "later may still load it (its owner, written first, keeps it private)",
    )
    stream_chunks_per_s: float = setting(
        8000.0,
        help="the chunks a second one gateway process streams to its clients, shared by the "
        "answers it streams from this project's sites: with n of them, an answer's chunks come "
        "at most every n / this seconds, the tokens between them in one chunk (one SSE event); "
        "its first token and its finish at once. Each chunk costs a socket write whatever its "
        "tokens: a few answers stream token by token, thousands several tokens to a chunk (0: "
        "no bound)",
    )
    stream_chunks_min_per_s: float = setting(
        0.0,
        help="with a value above 0, the chunk budget yields to a busy event loop down to this "
        "many chunks a second: the loop checks itself every 50 ms and cuts the budget while it "
        "wakes late, growing it back when it has room (gateway/sites/chunk_governor.py; chunks "
        "are the loop's one work that can shrink: the same tokens, fewer and fuller chunks). 0: "
        "a fixed budget. Off by default until the federation's runs show it helps there "
        "(bench/results/serving_path/serving_path_governor_r92.md)",
    )
    health_failures_to_down: int = setting(
        3,
        help="health checks in a row without an answer (deadline passed) before a site is "
        "marked unhealthy; a definite failure (connection refused, NOT_SERVING, wrong model or "
        "tokenizer) marks it at once. An overloaded site answers late, not never",
    )

    def __post_init__(self) -> None:
        require_positive(
            self,
            "health_interval_s",
            "connect_timeout_s",
            "load_report_stale_s",
            "adapter_load_timeout_s",
        )
        require_at_least(self, 1, "health_failures_to_down")
        if self.stream_chunks_per_s < 0:
            raise SettingsError("GATEWAY_STREAM_CHUNKS_PER_S >= 0 (0: no bound)")
        if self.stream_chunks_per_s and not (
            0 <= self.stream_chunks_min_per_s <= self.stream_chunks_per_s
        ):
            raise SettingsError(
                "GATEWAY_STREAM_CHUNKS_MIN_PER_S must be >= 0 (0: a fixed budget) and at most "
                f"GATEWAY_STREAM_CHUNKS_PER_S ({self.stream_chunks_per_s:g}), got "
                f"{self.stream_chunks_min_per_s:g}"
            )
        if self.load_report_interval_ms < 10:
            raise SettingsError("GATEWAY_LOAD_REPORT_INTERVAL_MS >= 10")


@dataclass(frozen=True, slots=True)
class OffloadSettings:
    """Offload negotiation: whether and how often to look, and what moving a request costs."""

    ENV_PREFIX: ClassVar[str] = "GATEWAY_OFFLOAD_"

    enabled: bool = setting(
        True,
        help="offload negotiation: queued, not-started requests move from a busy site to an idle "
        "one of the same model (see Routing)",
    )
    interval_s: float = setting(
        0.5, help="how often offload is looked for, and a draining site's queue released again"
    )
    transfer_cost_s: float = setting(
        0.05,
        help="a queued request moves only when its expected wait exceeds this (see Routing)",
    )

    def __post_init__(self) -> None:
        require_positive(self, "interval_s")
        if self.transfer_cost_s < 0:
            raise SettingsError("GATEWAY_OFFLOAD_TRANSFER_COST_S >= 0")


@dataclass(frozen=True, slots=True)
class LimitsSettings:
    """What one client request may ask and take."""

    ENV_PREFIX: ClassVar[str] = "GATEWAY_"

    request_timeout_s: float = setting(
        600.0,
        help="deadline of one completion, over every site it tries; past it: 504 "
        "`request_timeout`, and the site cancels it",
    )
    open_answer_timeout_s: float | None = setting(
        None,
        help="how long an answer whose client set no length limit (chat or Responses without "
        "`max_tokens`) may run, from its dispatch: then it ends with finish_reason `length` "
        "and what was generated, billed as generated, never a 504; below "
        '`GATEWAY_REQUEST_TIMEOUT_S` (docs/openai-api.md, "Answers without a limit")',
        shown_default="half `GATEWAY_REQUEST_TIMEOUT_S`",
    )
    max_continuations: int = setting(
        2,
        help="how many times an answer whose site fails mid-stream may continue on another site "
        "(0: it fails with its site)",
    )
    max_in_flight: int = setting(
        1024,
        help="client requests one gateway holds at once; beyond: 429 `gateway_overloaded` with "
        "`Retry-After`",
    )
    idempotency_ttl_s: float = setting(
        86400.0, help="how long an `Idempotency-Key`'s stored result answers retries"
    )
    max_body_bytes: int = setting(
        1 << 20,
        help="larger request bodies get 413; also the most one batch item (inline, or a line of "
        "a file) may hold (400 `request_too_large`)",
    )
    max_prompt_chars_per_token: int = setting(
        32,
        help="a prompt (or rendered chat) longer than this many characters per token of the "
        "model's context is refused (400 `context_length_exceeded`) before it is tokenized",
    )
    default_max_tokens: int = setting(
        16,
        help="/v1/completions' default when `max_tokens` is absent (OpenAI's); a chat "
        "completion without it runs to its end, the model's context or "
        "`GATEWAY_OPEN_ANSWER_TIMEOUT_S`",
    )
    max_choices: int = setting(
        8, help="the most choices (`n`) one request may ask for; more get 400 naming `n`"
    )
    send_stall_timeout_s: float = setting(
        30.0,
        help="a client that takes none of its answer for this long (it stopped reading) is cut "
        "off and its request cancelled, which frees its gateway and key slots",
    )
    header_timeout_s: float = setting(
        10.0,
        help="a request's headers must be complete this long after its connection opened or "
        "its previous answer ended; else 408 `request_timeout` and the connection is closed",
    )
    max_header_bytes: int = setting(
        65536,
        help="the most a request line and its headers may take together; past it 431 "
        "`headers_too_large` before the rest is read, and the connection is closed",
    )
    keep_alive_timeout_s: int = setting(
        5,
        help="a connection with no request under way (a new one included) that sends nothing "
        "for this long is closed",
    )
    body_timeout_s: float = setting(
        10.0,
        help="a request body gets this long, plus a second per `GATEWAY_BODY_MIN_BYTES_PER_S` "
        "bytes it has sent (time the gateway is not reading does not count); a slower one gets "
        "408 `request_timeout` and its connection is closed, freeing what its request held (an "
        "upload slot)",
    )
    body_min_bytes_per_s: int = setting(
        16384, help="the slowest a request body may arrive after its first `GATEWAY_BODY_TIMEOUT_S`"
    )
    token_limit_overshoot: float = setting(
        1.2,
        help="what the requests a key has admitted within a minute may take together, as a "
        "multiple of its `tokens_per_minute`, whatever their answers' predicted lengths: a "
        "request is admitted only if its prompt + `max_tokens` fits beside the minute's tokens "
        "and what its key's unfinished requests may still take (under-predicted answers cannot "
        "run a key past it)",
    )
    outcome_backlog_max: int = setting(
        100_000,
        help="requests whose rows or outcomes the database has not taken yet, kept in memory "
        "and written once it does (usage is never dropped); while this many wait, new requests "
        "get 503 with `Retry-After`",
    )

    def __post_init__(self) -> None:
        require_positive(
            self,
            "request_timeout_s",
            "send_stall_timeout_s",
            "header_timeout_s",
            "keep_alive_timeout_s",
            "body_timeout_s",
            "body_min_bytes_per_s",
        )
        open_answer = self.open_answer_timeout_s
        if open_answer is not None and not 0 < open_answer < self.request_timeout_s:
            raise SettingsError(
                "GATEWAY_OPEN_ANSWER_TIMEOUT_S must be > 0 and below GATEWAY_REQUEST_TIMEOUT_S "
                f"({self.request_timeout_s:g}), got {open_answer:g}"
            )
        require_at_least(self, 0, "max_continuations")
        require_at_least(self, 1, "outcome_backlog_max", "max_choices")
        require_at_least(self, 4096, "max_header_bytes")
        if self.max_in_flight < 1 or self.idempotency_ttl_s <= 0:
            raise SettingsError("GATEWAY_MAX_IN_FLIGHT >= 1, GATEWAY_IDEMPOTENCY_TTL_S > 0")
        if self.token_limit_overshoot < 1:
            raise SettingsError("GATEWAY_TOKEN_LIMIT_OVERSHOOT >= 1")
        if self.max_prompt_chars_per_token < 1:
            raise SettingsError("GATEWAY_MAX_PROMPT_CHARS_PER_TOKEN >= 1")
        if self.max_body_bytes < 1024 or self.default_max_tokens < 1:
            raise SettingsError("GATEWAY_MAX_BODY_BYTES >= 1024, GATEWAY_DEFAULT_MAX_TOKENS >= 1")

    @property
    def open_answer_s(self) -> float:
        """How long an answer without a client's length limit may run (see the setting)."""
        if self.open_answer_timeout_s is not None:
            return self.open_answer_timeout_s
        return self.request_timeout_s / 2


@dataclass(frozen=True, slots=True)
class PredictorSettings:
    ENV_PREFIX: ClassVar[str] = "GATEWAY_"

    default_dir: Path | None = setting(
        None,
        env="PREDICTOR_DIR",
        help="the default length-predictor artifact (for models without their own, named in the "
        "federation file) when the registry names no active default version; none: fallback "
        "mode",
    )
    poll_s: float = setting(
        10.0,
        env="PREDICTOR_POLL_S",
        help="how often the predictor registry is checked for a newly activated version",
    )
    collect_samples: bool = setting(
        True,
        help="record (prompt, true completion tokens) of finished requests for retraining",
    )

    def __post_init__(self) -> None:
        require_positive(self, "poll_s")


@dataclass(frozen=True, slots=True)
class HistorySettings:
    """The admin dashboard's history of site load."""

    ENV_PREFIX: ClassVar[str] = "GATEWAY_"

    load_sample_interval_s: float = setting(
        10.0,
        help="the dashboard's history: one load sample per site this often (rolled up into "
        "5-minute sums)",
    )
    load_history_retention_h: float = setting(
        168.0, help="samples and rollups older than this are deleted"
    )

    def __post_init__(self) -> None:
        if self.load_sample_interval_s <= 0 or self.load_history_retention_h <= 0:
            raise SettingsError(
                "GATEWAY_LOAD_SAMPLE_INTERVAL_S > 0, GATEWAY_LOAD_HISTORY_RETENTION_H > 0"
            )


@dataclass(frozen=True, slots=True)
class ScalingSettings:
    """Capacity that follows load (docs/elastic.md)."""

    ENV_PREFIX: ClassVar[str] = "GATEWAY_SCALING_"

    file: Path | None = setting(
        None,
        help="JSON file of the models whose sites scale with their predicted work: bounds, "
        "backlog target, hysteresis, and the actuator (`local` site processes, `kubernetes` "
        "pods, or `signal`: the desired-sites metric only); none: the sites are the federation "
        "file's and the admin API's (docs/elastic.md)",
    )


def _check_policy(policy: str, federation_file: Path) -> None:
    """A built-in profile, or one the federation file defines (read here only for such a name)."""
    if policy in ROUTING_POLICIES:
        return
    try:
        custom = [profile.name for profile in load_federation(federation_file).routing_profiles]
    except FederationConfigError as exc:
        custom, why = [], f" ({exc})"
    else:
        why = ""
    if policy not in custom:
        raise SettingsError(
            f"GATEWAY_ROUTING_POLICY must be a built-in routing profile {ROUTING_POLICIES} or one "
            f"of the federation file's routing_profiles {custom}{why}, got {policy!r}"
        )


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    ENV_PREFIX: ClassVar[str] = "GATEWAY_"

    federation_file: Path = setting(
        help="JSON file of models (name, tokenizer dir, optional `chat_template` file) and sites "
        "(name, cloud, region, endpoint, model, capacity_weight, optional `prefill_tokens_per_s`: "
        "the site's prefill speed for the cost model, else what its load reports measure)"
    )
    server: ServerSettings = field(default_factory=ServerSettings)
    database: DatabaseSettings = field(default_factory=DatabaseSettings)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    sites: SitesSettings = field(default_factory=SitesSettings)
    offload: OffloadSettings = field(default_factory=OffloadSettings)
    queue: QueueSettings = field(default_factory=QueueSettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    predictor: PredictorSettings = field(default_factory=PredictorSettings)
    drift: DriftSettings = field(default_factory=DriftSettings)
    retrain: RetrainSettings = field(default_factory=RetrainSettings)
    batches: BatchSettings = field(default_factory=BatchSettings)
    files: FileSettings = field(default_factory=FileSettings)
    responses: ResponseSettings = field(default_factory=ResponseSettings)
    fine_tuning: FineTuningSettings = field(default_factory=FineTuningSettings)
    admin: AdminSettings = field(default_factory=AdminSettings)
    history: HistorySettings = field(default_factory=HistorySettings)
    access: AccessSettings = field(default_factory=AccessSettings)
    site_tls: SiteTlsSettings = field(default_factory=SiteTlsSettings)
    scaling: ScalingSettings = field(default_factory=ScalingSettings)

    def __post_init__(self) -> None:
        _check_policy(self.routing.policy, self.federation_file)
        if self.server.workers > 1 and not self.database.url.startswith("postgresql"):
            raise SettingsError(
                f"GATEWAY_WORKERS={self.server.workers} needs PostgreSQL "
                "(GATEWAY_DATABASE_URL=postgresql+psycopg://...): on SQLite key limits and the "
                "other state every worker must share live in one process's memory"
            )
        access, host = self.access, self.server.host
        if not (access.require_api_keys or access.allow_open_access or is_loopback(host)):
            raise SettingsError(
                f"GATEWAY_HOST={host} is not a loopback address, so clients must present "
                "API keys: set GATEWAY_REQUIRE_API_KEYS=true (with GATEWAY_ADMIN_TOKEN), or "
                "GATEWAY_ALLOW_OPEN_ACCESS=true to serve anyone without a key"
            )
        if access.require_api_keys and self.admin.token is None:
            raise SettingsError(
                "GATEWAY_REQUIRE_API_KEYS needs GATEWAY_ADMIN_TOKEN: keys are created through "
                "the admin API (GATEWAY_REQUIRE_API_KEYS is on by default when GATEWAY_HOST is "
                "not loopback; GATEWAY_ALLOW_OPEN_ACCESS=true serves without keys)"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GatewaySettings:
        values = read_env(cls, os.environ if environ is None else environ)
        if "federation_file" not in values:
            raise SettingsError(
                "GATEWAY_FEDERATION_FILE must name the JSON file listing models and sites"
            )
        # A keyless caller on a reachable address would escape every limit its key carries.
        host = build(ServerSettings, values.get("server", {})).host
        access = values.setdefault("access", {})
        open_access = access.get("allow_open_access", False)
        access.setdefault("require_api_keys", not (is_loopback(host) or open_access))
        return build(cls, values)


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (a name other than localhost counts as open)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
