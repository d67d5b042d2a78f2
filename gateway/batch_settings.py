"""The settings of the APIs that keep what clients sent or were answered: Files, Batches and
stored responses (GATEWAY_FILE_*, GATEWAY_BATCH_*, GATEWAY_RESPONSE_*), in GatewaySettings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from fedllm_contract.env_settings import (
    SettingsError,
    require_at_least,
    require_positive,
    setting,
)
from fedllm_contract.fine_tuning import MAX_JOB_FILES_BYTES

# The order a site starts a batch's items in (gateway/batches/plan.py): BlendServe's resource-
# aware prefix tree, the longest planned answer first, as submitted, or depth-first by prefix.
BatchOrder = Literal["blend", "longest_first", "submission", "dfs"]
BATCH_ORDERS: tuple[BatchOrder, ...] = ("blend", "longest_first", "submission", "dfs")


@dataclass(frozen=True, slots=True)
class BatchSettings:
    ENV_PREFIX: ClassVar[str] = "GATEWAY_BATCH_"

    max_items: int = setting(100_000, help="most requests in one `POST /v1/batches`")
    max_body_bytes: int = setting(
        64 << 20,
        help="largest batch body (413 beyond; `GATEWAY_MAX_BODY_BYTES` is for the other endpoints)",
    )
    site_concurrency: int = setting(
        16,
        help="most batch items in flight per site, all batches together; fewer while the site "
        "has few slots its interactive work leaves free (background work there does not count)",
    )
    order: BatchOrder = setting(
        "blend",
        help="the order a batch's items start in, and how they are spread over sites: `blend` "
        "(BlendServe's resource-aware prefix tree: compute- and memory-dense items side by side, "
        "prefixes kept together, each site a range of whole subtrees), `longest_first` (the "
        "longest planned answer first, sites by MICO or the cost model), `submission`, `dfs` "
        "(depth-first by prompt prefix)",
    )
    blend_block_tokens: int = setting(
        16, help="tokens per prefix block of the `blend` and `dfs` orders' prefix tree"
    )
    blend_split_budget: float = setting(
        0.02,
        help="share of a batch's prompt tokens that `blend` may recompute to move an outlier "
        "subtree next to requests of its compute density",
    )
    blend_peak_tflops: float = setting(
        989.0, help="the GPU's dense bf16 peak the `blend` roofline assumes (H100 SXM)"
    )
    blend_memory_gbps: float = setting(
        3350.0, help="the GPU's memory bandwidth in GB/s the `blend` roofline assumes (H100 SXM)"
    )
    blend_model_params_b: float = setting(
        8.0, help="the model's parameters in billions, for the `blend` roofline's compute time"
    )
    blend_kv_bytes_per_token: int = setting(
        131072,
        help="KV cache bytes per token (all layers, K and V), for the `blend` roofline's memory "
        "time (Llama-3-8B in bf16: 131072)",
    )
    deadline_margin: float = setting(
        0.25,
        help="a batch whose completion window has less than this share left, or less time than "
        "its remaining items' predicted run time, is started ahead of the other batches on its "
        "sites",
    )
    max_attempts: int = setting(
        3, help="starts of a batch item before a server-side failure (5xx, 429) is final"
    )
    lease_s: float = setting(
        30.0,
        help="a gateway's lease on a batch it runs; another gateway resumes the batch once it "
        "lapses",
    )
    uploads_in_flight: int = setting(
        4,
        help="files and batches one gateway validates at once (parses, tokenizes); an upload "
        "whose body is in waits its turn for one of these places",
    )
    uploads_per_key: int = setting(
        1,
        help="files and batches one key may have under way at once, from the first byte to the "
        "answer; beyond, 429 `gateway_overloaded` with `Retry-After` before the body is read. "
        "Receiving is bounded only per key, so a key whose bodies stall never holds another's "
        "(a slow body is cut by `GATEWAY_BODY_TIMEOUT_S`)",
    )

    def __post_init__(self) -> None:
        if self.order not in BATCH_ORDERS:
            raise SettingsError(
                f"GATEWAY_BATCH_ORDER must be one of {BATCH_ORDERS}, got {self.order!r}"
            )
        if not 0.0 <= self.blend_split_budget <= 1.0 or not 0.0 <= self.deadline_margin <= 1.0:
            raise SettingsError(
                "GATEWAY_BATCH_BLEND_SPLIT_BUDGET and GATEWAY_BATCH_DEADLINE_MARGIN are in [0, 1]"
            )
        require_positive(self, "blend_peak_tflops", "blend_memory_gbps", "blend_model_params_b")
        require_at_least(
            self,
            1,
            "max_items",
            "site_concurrency",
            "blend_block_tokens",
            "blend_kv_bytes_per_token",
            "max_attempts",
            "uploads_in_flight",
            "uploads_per_key",
        )
        if self.max_body_bytes < 1024 or self.lease_s <= 0:
            raise SettingsError("GATEWAY_BATCH_MAX_BODY_BYTES >= 1024, GATEWAY_BATCH_LEASE_S > 0")


@dataclass(frozen=True, slots=True)
class FineTuningSettings:
    """The fine-tuning API (gateway/fine_tuning/): jobs trained on sites, polled from here."""

    ENV_PREFIX: ClassVar[str] = "GATEWAY_FINE_TUNING_"

    poll_s: float = setting(
        2.0,
        help="how often the gateway asks each site after its fine-tuning jobs (their steps, "
        "checkpoints and end) and hands queued jobs to sites; a new job is handed at once",
    )

    max_file_bytes: int = setting(
        MAX_JOB_FILES_BYTES,
        help="the most a fine-tuning job's files (training and validation together) may hold, "
        "checked at upload (`purpose: fine-tune`) and when a job is made: 400 `file_too_large` "
        "naming this limit. At most 64 MiB, what a site takes in the one message that starts "
        "a job",
    )
    jobs_per_key: int = setting(
        2,
        help="fine-tuning jobs one key may have unfinished (queued or running) at once; its "
        "next one gets 429 `fine_tuning_jobs_limit_exceeded` until one ends",
    )
    tokens_per_key_day: int = setting(
        50_000_000,
        help="tokens one key may train in 24 hours (a job's estimate: its training file's "
        "bytes / 4 x its epochs, then what the site reports trained), its own budget apart "
        "from inference; a key with a `tokens_per_minute` limit gets at most 1,440 times that. "
        "Beyond: 429 `training_tokens_limit_exceeded`",
    )
    start_timeout_s: float = setting(
        3600.0,
        help="a queued job that no site has taken this long after it was made fails "
        "(`error.code` `no_site_took_job`) instead of waiting for ever",
    )
    validation_workers: int = setting(
        1,
        help="processes that check fine-tuning files when jobs are made (their own: the "
        "tokenize pool that prepares chat requests is never held by them), started once a site "
        "trains jobs; further checks wait their turn, keys round robin, their files in the "
        "database until then",
    )
    validation_cpu_share: float = setting(
        0.5,
        help="the share of a CPU each file-checking process holds itself to (it sleeps after "
        "each slice of work for as long as this says), so that serving beside it finds a free "
        "CPU; a check then takes at most 1 / this its CPU time. 1: no pauses",
    )
    validations_per_key: int = setting(
        1,
        help="jobs one key may have `validating_files` at once (counted in the transaction "
        "that makes a job, with the checks this gateway holds of the key's jobs); its next "
        "create gets 429 `fine_tuning_validations_limit_exceeded` until the check ends (a "
        "cancelled job's check stops at once)",
    )
    validation_timeout_s: float = setting(
        900.0,
        help="a job still `validating_files` this long after it was made (the gateway "
        "checking it stopped) fails (`error.code` `validation_timeout`)",
    )

    def __post_init__(self) -> None:
        require_positive(self, "poll_s", "start_timeout_s", "validation_timeout_s")
        if not 0 < self.validation_cpu_share <= 1:
            raise SettingsError(
                "GATEWAY_FINE_TUNING_VALIDATION_CPU_SHARE must be in (0, 1], not "
                f"{self.validation_cpu_share}"
            )
        require_at_least(
            self, 1, "jobs_per_key", "tokens_per_key_day", "validation_workers",
            "validations_per_key",
        )  # fmt: skip
        if not 1024 <= self.max_file_bytes <= MAX_JOB_FILES_BYTES:
            raise SettingsError(
                f"GATEWAY_FINE_TUNING_MAX_FILE_BYTES must be in 1024..{MAX_JOB_FILES_BYTES} "
                "(what a site takes in one message)"
            )


@dataclass(frozen=True, slots=True)
class FileSettings:
    """The Files API (gateway/files/): files live in the database (`files`, `file_parts`)."""

    ENV_PREFIX: ClassVar[str] = "GATEWAY_FILE_"

    max_bytes: int = setting(
        64 << 20,
        help="largest file `POST /v1/files` takes (413 `file_too_large` as soon as the upload "
        "passes it)",
    )
    storage_per_key_bytes: int = setting(
        1 << 30,
        help="what one key's live uploads may hold together (400 `storage_limit_exceeded` "
        "beyond; batches' result files do not count)",
    )
    retention_h: float = setting(
        720.0,
        help="how long a file is kept (uploads without `expires_after`, and batches' result "
        "files); expired files are deleted every 10 minutes",
    )

    def __post_init__(self) -> None:
        if self.max_bytes < 1024:
            raise SettingsError(f"GATEWAY_FILE_MAX_BYTES must be >= 1024, got {self.max_bytes}")
        if self.storage_per_key_bytes < self.max_bytes:
            raise SettingsError(
                "GATEWAY_FILE_STORAGE_PER_KEY_BYTES must be >= GATEWAY_FILE_MAX_BYTES"
            )
        require_positive(self, "retention_h")


@dataclass(frozen=True, slots=True)
class ResponseSettings:
    """The Responses API (gateway/responses/): stored responses live in the database
    (`responses`)."""

    ENV_PREFIX: ClassVar[str] = "GATEWAY_RESPONSE_"

    retention_h: float = setting(
        720.0,
        help="how long a stored response (`POST /v1/responses` without `store: false`) can be "
        "read and continued with `previous_response_id` (OpenAI's 30 days); expired ones are "
        "deleted every 10 minutes",
    )

    def __post_init__(self) -> None:
        require_positive(self, "retention_h")
