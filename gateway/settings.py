"""Gateway settings: read once from GATEWAY_* environment variables and validated loudly."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from gateway.routing.types import UNPREDICTED_PLANS, UnpredictedPlan

ROUTING_POLICIES = ("round_robin", "least_requests", "least_tokens", "mico")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class SettingsError(ValueError):
    """A setting is missing or invalid; the message names the variable."""


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    federation_file: Path
    database_url: str = "sqlite+aiosqlite:///var/gateway.db"
    host: str = "127.0.0.1"
    port: int = 8000
    routing_policy: str = "round_robin"
    auto_migrate: bool = True
    # How often each site's health and info are polled.
    health_interval_s: float = 2.0
    # A site that has not answered a health check for this long receives nothing new.
    connect_timeout_s: float = 2.0
    # Upper bound on one completion, end to end.
    request_timeout_s: float = 600.0
    max_body_bytes: int = 1 << 20
    # A prompt longer than this many characters per token of the model's context is refused
    # before it is tokenized: it cannot fit, and tokenizing it would hold the event loop.
    max_prompt_chars_per_token: int = 32
    # Threads that tokenize prompts off the event loop (gateway/tokenize_pool.py).
    tokenize_threads: int = 2
    default_max_tokens: int = 16
    # Prompts reach the logs only with log_prompts on; API keys, the admin token and TLS keys
    # never do (docs/security.md).
    log_prompts: bool = False
    log_level: str = "INFO"
    # Mutual TLS to the sites (gateway/sites/tls.py): the CA that signs site certificates and
    # this gateway's client certificate and key; all three or none (none: plaintext channels).
    site_tls_ca: Path | None = None
    site_tls_cert: Path | None = None
    site_tls_key: Path | None = None
    # The operator credential for /admin, the admin API and /metrics (Bearer token, or the
    # dashboard's session cookie derived from it). Unset: those endpoints refuse everyone.
    admin_token: str | None = None
    # A dashboard sign-in ends this long after it began, checked on the server.
    admin_session_ttl_s: float = 12 * 3600.0
    # The OpenAPI UI pages (Swagger, ReDoc, ...) load scripts from third-party CDNs on the admin
    # cookie's origin: off unless asked for. The schema itself (/schema/openapi.json) is served.
    openapi_ui: bool = False
    # Client APIs answer 401 without a live API key (keys are made through the admin API). Off,
    # callers without a key are served anonymously; a key that is sent is still checked. Read
    # from the environment it defaults to on for any non-loopback host: a keyless caller would
    # otherwise escape every limit its key carries.
    require_api_keys: bool = False
    # The explicit, loud override for serving a non-loopback address without keys.
    allow_open_access: bool = False
    # A length-predictor artifact to serve when the database names no active version. Without
    # either, the gateway runs in fallback mode: no predictions, engines plan with max_tokens.
    predictor_dir: Path | None = None
    # How often the registry of predictor versions is checked for a newly activated one.
    predictor_poll_s: float = 10.0
    # Record (prompt, true completion tokens) of finished requests for retraining.
    collect_samples: bool = True
    # Load reports the sites push; a site silent for load_report_stale_s receives nothing new.
    load_report_interval_ms: int = 250
    load_report_stale_s: float = 5.0
    # Offload negotiation: how often to look, and what moving a queued request costs.
    offload_enabled: bool = True
    offload_interval_s: float = 0.5
    offload_transfer_cost_s: float = 0.05
    # Batch API: most requests in one batch and its largest body; batch items in flight per site
    # (all batches together); starts of an item before a server-side failure is final; the lease
    # a gateway holds on a batch it runs (another gateway resumes the batch once it lapses).
    batch_max_items: int = 100_000
    batch_max_body_bytes: int = 64 << 20
    batch_site_concurrency: int = 16
    batch_max_attempts: int = 3
    batch_lease_s: float = 30.0
    # Admin dashboard history: one load sample per site every load_sample_interval_s, kept for
    # load_history_retention_h hours (older rows are deleted by the sampler).
    load_sample_interval_s: float = 10.0
    load_history_retention_h: float = 168.0
    # Reliability (docs/reliability.md). An answer whose site fails mid-stream continues on
    # another site at most max_continuations times (0: it fails with the site).
    max_continuations: int = 2
    # Bounded admission: client requests this gateway holds at once (over it: 429), and the
    # queue a site may have before routing leaves it out (0: no bound; all full: 503).
    max_in_flight: int = 1024
    site_max_queued_requests: int = 256
    site_max_queued_tokens: int = 0
    # How long an Idempotency-Key's stored result answers retries.
    idempotency_ttl_s: float = 86400.0
    # What routing plans for an answer it has no prediction for (gateway/routing/types.py).
    plan_without_prediction: UnpredictedPlan = "max_tokens"

    def __post_init__(self) -> None:
        if self.routing_policy not in ROUTING_POLICIES:
            raise SettingsError(
                f"GATEWAY_ROUTING_POLICY must be one of {ROUTING_POLICIES}, "
                f"got {self.routing_policy!r}"
            )
        try:
            make_url(self.database_url)
        except ArgumentError as exc:
            raise SettingsError(f"GATEWAY_DATABASE_URL is not a database URL: {exc}") from exc
        if self.plan_without_prediction not in UNPREDICTED_PLANS:
            raise SettingsError(
                f"GATEWAY_PLAN_WITHOUT_PREDICTION must be one of {UNPREDICTED_PLANS}, "
                f"got {self.plan_without_prediction!r}"
            )
        if not 0 <= self.port < 65536:
            raise SettingsError(f"GATEWAY_PORT must be in 0..65535, got {self.port}")
        for name in (
            "health_interval_s",
            "connect_timeout_s",
            "request_timeout_s",
            "predictor_poll_s",
            "load_report_stale_s",
            "offload_interval_s",
            "admin_session_ttl_s",
        ):
            if getattr(self, name) <= 0:
                raise SettingsError(f"GATEWAY_{name.upper()} must be > 0")
        if self.load_report_interval_ms < 10 or self.offload_transfer_cost_s < 0:
            raise SettingsError(
                "GATEWAY_LOAD_REPORT_INTERVAL_MS >= 10, GATEWAY_OFFLOAD_TRANSFER_COST_S >= 0"
            )
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise SettingsError("GATEWAY_ADMIN_TOKEN must be at least 16 characters")
        if not (self.require_api_keys or self.allow_open_access or is_loopback(self.host)):
            raise SettingsError(
                f"GATEWAY_HOST={self.host} is not a loopback address, so clients must present "
                "API keys: set GATEWAY_REQUIRE_API_KEYS=true (with GATEWAY_ADMIN_TOKEN), or "
                "GATEWAY_ALLOW_OPEN_ACCESS=true to serve anyone without a key"
            )
        if self.require_api_keys and self.admin_token is None:
            raise SettingsError(
                "GATEWAY_REQUIRE_API_KEYS needs GATEWAY_ADMIN_TOKEN: keys are created through "
                "the admin API (GATEWAY_REQUIRE_API_KEYS is on by default when GATEWAY_HOST is "
                "not loopback; GATEWAY_ALLOW_OPEN_ACCESS=true serves without keys)"
            )
        tls = {
            "GATEWAY_SITE_TLS_CA": self.site_tls_ca,
            "GATEWAY_SITE_TLS_CERT": self.site_tls_cert,
            "GATEWAY_SITE_TLS_KEY": self.site_tls_key,
        }
        if any(tls.values()) and not all(tls.values()):
            missing = [name for name, path in tls.items() if path is None]
            raise SettingsError(f"TLS needs all of {list(tls)} or none; missing {missing}")
        if self.log_level not in LOG_LEVELS:
            raise SettingsError(
                f"GATEWAY_LOG_LEVEL must be one of {LOG_LEVELS}, got {self.log_level!r}"
            )
        if self.max_prompt_chars_per_token < 1 or self.tokenize_threads < 1:
            raise SettingsError(
                "GATEWAY_MAX_PROMPT_CHARS_PER_TOKEN >= 1, GATEWAY_TOKENIZE_THREADS >= 1"
            )
        if self.max_body_bytes < 1024 or self.default_max_tokens < 1:
            raise SettingsError("GATEWAY_MAX_BODY_BYTES >= 1024, GATEWAY_DEFAULT_MAX_TOKENS >= 1")
        for name in ("batch_max_items", "batch_site_concurrency", "batch_max_attempts"):
            if getattr(self, name) < 1:
                raise SettingsError(f"GATEWAY_{name.upper()} must be >= 1")
        if self.batch_max_body_bytes < 1024 or self.batch_lease_s <= 0:
            raise SettingsError("GATEWAY_BATCH_MAX_BODY_BYTES >= 1024, GATEWAY_BATCH_LEASE_S > 0")
        if self.load_sample_interval_s <= 0 or self.load_history_retention_h <= 0:
            raise SettingsError(
                "GATEWAY_LOAD_SAMPLE_INTERVAL_S > 0, GATEWAY_LOAD_HISTORY_RETENTION_H > 0"
            )
        for name in ("max_continuations", "site_max_queued_requests", "site_max_queued_tokens"):
            if getattr(self, name) < 0:
                raise SettingsError(f"GATEWAY_{name.upper()} must be >= 0")
        if self.max_in_flight < 1 or self.idempotency_ttl_s <= 0:
            raise SettingsError("GATEWAY_MAX_IN_FLIGHT >= 1, GATEWAY_IDEMPOTENCY_TTL_S > 0")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GatewaySettings:
        env = os.environ if environ is None else environ
        federation = env.get("GATEWAY_FEDERATION_FILE")
        if not federation:
            raise SettingsError(
                "GATEWAY_FEDERATION_FILE must name the JSON file listing models and sites"
            )
        reader = _EnvReader(env)
        defaults = cls(federation_file=Path(federation))
        host = reader.text("HOST", defaults.host)
        allow_open_access = reader.boolean("ALLOW_OPEN_ACCESS", defaults.allow_open_access)
        return cls(
            federation_file=Path(federation),
            database_url=reader.text("DATABASE_URL", defaults.database_url),
            host=host,
            port=reader.integer("PORT", defaults.port),
            routing_policy=reader.text("ROUTING_POLICY", defaults.routing_policy),
            plan_without_prediction=cast(
                UnpredictedPlan,
                reader.text("PLAN_WITHOUT_PREDICTION", defaults.plan_without_prediction),
            ),
            auto_migrate=reader.boolean("AUTO_MIGRATE", defaults.auto_migrate),
            health_interval_s=reader.number("HEALTH_INTERVAL_S", defaults.health_interval_s),
            connect_timeout_s=reader.number("CONNECT_TIMEOUT_S", defaults.connect_timeout_s),
            request_timeout_s=reader.number("REQUEST_TIMEOUT_S", defaults.request_timeout_s),
            max_body_bytes=reader.integer("MAX_BODY_BYTES", defaults.max_body_bytes),
            default_max_tokens=reader.integer("DEFAULT_MAX_TOKENS", defaults.default_max_tokens),
            max_prompt_chars_per_token=reader.integer(
                "MAX_PROMPT_CHARS_PER_TOKEN", defaults.max_prompt_chars_per_token
            ),
            tokenize_threads=reader.integer("TOKENIZE_THREADS", defaults.tokenize_threads),
            log_prompts=reader.boolean("LOG_PROMPTS", defaults.log_prompts),
            log_level=reader.text("LOG_LEVEL", defaults.log_level),
            site_tls_ca=reader.path("SITE_TLS_CA"),
            site_tls_cert=reader.path("SITE_TLS_CERT"),
            site_tls_key=reader.path("SITE_TLS_KEY"),
            admin_token=env.get("GATEWAY_ADMIN_TOKEN") or None,
            admin_session_ttl_s=reader.number("ADMIN_SESSION_TTL_S", defaults.admin_session_ttl_s),
            openapi_ui=reader.boolean("OPENAPI_UI", defaults.openapi_ui),
            require_api_keys=reader.boolean(
                "REQUIRE_API_KEYS", not (is_loopback(host) or allow_open_access)
            ),
            allow_open_access=allow_open_access,
            predictor_dir=reader.path("PREDICTOR_DIR"),
            predictor_poll_s=reader.number("PREDICTOR_POLL_S", defaults.predictor_poll_s),
            collect_samples=reader.boolean("COLLECT_SAMPLES", defaults.collect_samples),
            load_report_interval_ms=reader.integer(
                "LOAD_REPORT_INTERVAL_MS", defaults.load_report_interval_ms
            ),
            load_report_stale_s=reader.number("LOAD_REPORT_STALE_S", defaults.load_report_stale_s),
            offload_enabled=reader.boolean("OFFLOAD_ENABLED", defaults.offload_enabled),
            offload_interval_s=reader.number("OFFLOAD_INTERVAL_S", defaults.offload_interval_s),
            offload_transfer_cost_s=reader.number(
                "OFFLOAD_TRANSFER_COST_S", defaults.offload_transfer_cost_s
            ),
            batch_max_items=reader.integer("BATCH_MAX_ITEMS", defaults.batch_max_items),
            batch_max_body_bytes=reader.integer(
                "BATCH_MAX_BODY_BYTES", defaults.batch_max_body_bytes
            ),
            batch_site_concurrency=reader.integer(
                "BATCH_SITE_CONCURRENCY", defaults.batch_site_concurrency
            ),
            batch_max_attempts=reader.integer("BATCH_MAX_ATTEMPTS", defaults.batch_max_attempts),
            batch_lease_s=reader.number("BATCH_LEASE_S", defaults.batch_lease_s),
            load_sample_interval_s=reader.number(
                "LOAD_SAMPLE_INTERVAL_S", defaults.load_sample_interval_s
            ),
            load_history_retention_h=reader.number(
                "LOAD_HISTORY_RETENTION_H", defaults.load_history_retention_h
            ),
            max_continuations=reader.integer("MAX_CONTINUATIONS", defaults.max_continuations),
            max_in_flight=reader.integer("MAX_IN_FLIGHT", defaults.max_in_flight),
            site_max_queued_requests=reader.integer(
                "SITE_MAX_QUEUED_REQUESTS", defaults.site_max_queued_requests
            ),
            site_max_queued_tokens=reader.integer(
                "SITE_MAX_QUEUED_TOKENS", defaults.site_max_queued_tokens
            ),
            idempotency_ttl_s=reader.number("IDEMPOTENCY_TTL_S", defaults.idempotency_ttl_s),
        )


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (a name other than localhost counts as open)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class _EnvReader:
    env: Mapping[str, str]

    def _raw(self, name: str) -> str | None:
        value = self.env.get(f"GATEWAY_{name}")
        return value if value not in (None, "") else None

    def text(self, name: str, default: str) -> str:
        return self._raw(name) or default

    def path(self, name: str) -> Path | None:
        raw = self._raw(name)
        return Path(raw) if raw is not None else None

    def integer(self, name: str, default: int) -> int:
        raw = self._raw(name)
        try:
            return default if raw is None else int(raw)
        except ValueError as exc:
            raise SettingsError(f"GATEWAY_{name} must be an integer, got {raw!r}") from exc

    def number(self, name: str, default: float) -> float:
        raw = self._raw(name)
        try:
            return default if raw is None else float(raw)
        except ValueError as exc:
            raise SettingsError(f"GATEWAY_{name} must be a number, got {raw!r}") from exc

    def boolean(self, name: str, default: bool) -> bool:
        raw = self._raw(name)
        if raw is None:
            return default
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"GATEWAY_{name} must be true or false, got {raw!r}")
