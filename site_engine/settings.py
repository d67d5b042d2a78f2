"""Site engine settings: read once from environment variables (SITE_*), overridable by CLI flags."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from fedllm_contract.env_settings import SettingsError, build, read_env
from fedllm_contract.fine_tuning import MAX_JOB_FILES_BYTES
from site_engine.engine.core.scheduling_policy import POLICY_NAMES, PolicyName
from site_engine.engine.lora.segmented_step import DEFAULT_LORA_KERNELS, LORA_KERNELS, LoraKernels
from site_engine.gguf_import import GgufImportError, find_gguf, model_name_of
from site_engine.idle_work import DEFAULT_BUSY_SHARE

# How fine-tuning shares the engine with serving (issue 70; docs/engine.md, Fine-tuning jobs).
FINETUNE_MODES = ("idle", "rows")
FineTuneMode = Literal["idle", "rows"]

DTYPES = ("float32", "bfloat16", "float16")
POLICIES = tuple(sorted(POLICY_NAMES))
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# What the site does with its model: generate text, embed it, or tell from the model directory
# (a sentence-transformers layout, modules.json with a Pooling module, is an embedding model).
Task = Literal["auto", "generate", "embed"]
TASKS: tuple[Task, ...] = ("auto", "generate", "embed")

__all__ = ["SettingsError", "SiteSettings", "default_model_name"]


@dataclass(frozen=True, slots=True)
class SiteSettings:
    ENV_PREFIX: ClassVar[str] = "SITE_"

    model_dir: Path
    site_name: str
    model_name: str
    tokenizer_dir: Path | None = None
    task: Task = "auto"
    host: str = "127.0.0.1"
    port: int = 50051
    device: str = "cpu"
    dtype: str = "float32"
    # None: chosen from the device at start (site_engine/engine/memory_plan.batch_defaults:
    # 16 and 2,048 on CPU, vLLM's defaults on a GPU) and logged. For an embedding model: inputs
    # and padded tokens per forward pass (site_engine/embedding/batcher.py).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    # KV cache budget in MiB; 0 sizes the cache from free device memory (GPU) or a default (CPU).
    kv_cache_mib: int = 0
    policy: PolicyName = "fcfs"
    # The deferral bound on background work (flex and batch classes): prefill tokens of theirs
    # per step at most, so that an interactive request arriving mid-step waits at most one
    # step with that much background in it before it joins (site_engine/engine/core/step_budget.py;
    # in seconds: this / the site's prefill tokens per second). 0: no bound.
    deferral_bound_tokens: int = 512
    # Its time side: while interactive requests run, background rows (decodes too) may add at
    # most this fraction of the step's interactive part, its time predicted from the steps run
    # (site_engine/engine/core/step_cost.py); 0: the token bound alone.
    deferral_bound_slack: float = 0.15
    # Automatic prefix caching (site_engine/engine/core/block_manager.py); --no-prefix-caching: off.
    prefix_caching: bool = True
    # CUDA only: serve at once, before any CUDA graph exists, and capture them between steps
    # (EngineConfig.lazy_graphs, docs/elastic.md). `load` turns it on for a CUDA site unless
    # SITE_LAZY_GRAPHS says otherwise (tests/gpu/test_lazy_graphs.py passed on an H100).
    lazy_graphs: bool = False
    # Host memory for the prefix cache's second tier, in GiB (pinned on CUDA); 0: none.
    host_kv_cache_gib: float = 0.0
    # The host tier's bandwidth share: bytes of copies to it per engine step at most (whole
    # blocks, at least one); a block worth a copy beyond it is simply evicted. And how many
    # steps after its request left a block counts as of a conversation still active, worth a
    # copy (site_engine/engine/core/host_offload.py).
    host_kv_offload_bytes_per_step: int = 32 << 20
    host_kv_active_window_steps: int = 2000
    load_report_interval_ms: int = 500
    # Intra-op threads for CPU execution. Several sites often share one host in tests and demos;
    # more threads than free cores makes every step slower (measured: 38 ms vs 5 ms per token).
    torch_threads: int = 1
    # Prometheus metrics over HTTP on this port (same host as gRPC); 0 serves none.
    metrics_port: int = 0
    # The OpenAI-compatible HTTP face (/v1/completions, /v1/chat/completions, /v1/models,
    # /metrics under vLLM's names) on this port, next to gRPC; 0 serves none. It has no TLS or
    # API keys of its own: on a non-loopback host put it behind a proxy that has them.
    http_port: int = 0
    # Mutual TLS on the gRPC port (site_engine/tls.py): all three or none; none serves plaintext.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    # The gateway's name in its client certificate (its common name or a DNS name): over mutual
    # TLS only a client presenting it may lend this site's KV memory and take it back (KvRoom,
    # LendKv, ReturnKv, RenewKvLease; site_engine/kv_lending_access.py). The CA signs every
    # site's certificate too (the health probe's), so the CA alone does not say "gateway".
    # None: nobody over TLS; over plaintext only a caller on loopback.
    gateway_identity: str | None = None
    # Plaintext on a non-loopback host lets anyone who reaches the port generate for free and
    # release or cancel others' queued requests: refused unless overridden with this.
    allow_plaintext: bool = False
    # Requests waiting for a batch slot; one more is refused with RESOURCE_EXHAUSTED (the
    # gateway then tries another site, or answers 503 with Retry-After).
    max_queued_requests: int = 1024
    # Structured outputs: grammars compile on this many threads, off the step loop; a compile
    # that runs longer than the timeout fails its requests with INVALID_ARGUMENT (a 400).
    grammar_compile_threads: int = 2
    grammar_compile_timeout_s: float = 5.0
    # LoRA adapters (site_engine/engine/lora/): a directory of PEFT adapters, each served under
    # its directory's name; None serves the base model only. Up to max_loras distinct adapters
    # run at once (device slots, each padded to max_lora_rank <= 64), max_cpu_loras stay loaded
    # in host memory (least recently used evicted). CPU (PyTorch) and CUDA (Triton kernels, graphs).
    # max_lora_loads adapters are read from disk at once, each on its own worker thread: with
    # one, a burst of cold adapters (many adapters, Zipf popularity) queues behind each other.
    lora_dir: Path | None = None
    max_loras: int = 4
    max_cpu_loras: int = 8
    # Host memory the adapters kept there may take at most (GiB, pinned on CUDA; 0: no bound
    # but max_cpu_loras): least recently used evicted first, never one a live request uses.
    max_cpu_lora_gib: float = 0.0
    max_lora_rank: int = 16
    max_lora_loads: int = 4
    # CUDA: the LoRA kernels a step runs (site_engine/engine/lora/segmented_step.py).
    lora_kernels: LoraKernels = DEFAULT_LORA_KERNELS
    # Adapter slots out of the KV cache's block pool (issue 69, S-LoRA's unified paging):
    # max_loras is then a cap, each resident adapter holds its bytes' worth of KV blocks, and
    # idle ones give them back when sequences need them. Off by default: the slot tensors are
    # still allocated at the cap beside the cache (docs/engine.md, LoRA).
    lora_unified_slots: bool = False
    # LoRA fine-tuning jobs trained in the engine's idle cycles (site_engine/finetune/): bytes
    # of device memory reserved for training (LoRA weights, optimizer state, one unit's
    # activations), taken from the KV cache's budget at start; 0 refuses every job. Jobs,
    # checkpoints (every `checkpoint_every` optimizer steps) and adapters live under
    # `finetune_dir`; units of training are sized in tokens so each is predicted to hold the
    # engine's loop `finetune_max_step_ms` at most (site_engine/finetune/pacing.py).
    finetune_reserve_bytes: int = 0
    # The reserve taken from the KV cache only while a job trains (the cache is planned at full
    # size, the reserve's top blocks drained and lent to the trainer when a job starts, given
    # back when none runs; docs/engine.md, Fine-tuning jobs). Off: held from the start, as before.
    finetune_reserve_on_demand: bool = False
    finetune_dir: Path = Path("var/finetune")
    # What `finetune_dir` may hold: a job whose files would take it past is refused at its
    # start; an ended job's files and checkpoints are cleared (issue 75). At least one job's
    # largest files (fedllm_contract.fine_tuning.MAX_JOB_FILES_BYTES).
    finetune_dir_max_bytes: int = 8 << 30
    finetune_checkpoint_every: int = 10
    finetune_max_step_ms: float = 200.0
    # While requests run, the most of the engine's time training units may take (a unit then
    # waits (1 - share) / share times its length after the last one): the same 15% that
    # background rows may add to an interactive step (deferral_bound_slack).
    finetune_busy_share: float = DEFAULT_BUSY_SHARE
    # With no request waiting or running, a unit of training takes up to this many padded
    # tokens (8 x 512) with no time bound: its pieces still hand the loop back within
    # finetune_max_step_ms, so a request arriving meanwhile waits one piece, not the unit.
    finetune_idle_unit_tokens: int = 4096
    # "idle": units between steps, paced by finetune_busy_share while requests run. "rows": a
    # bounded piece of the job with every step, sized to the room the serving batch leaves in
    # the step's token budget and to finetune_max_training_delay_ms, none while a request waits
    # (site_engine/finetune/step_work.py): a job that waits for idle time starves under steady
    # chat, since continuous batching almost never leaves a whole step idle.
    finetune_mode: FineTuneMode = "idle"
    # Rows mode: the most a step's training piece may delay it (pieces are sized to half of it;
    # finetune_max_step_ms does not apply then).
    finetune_max_training_delay_ms: float = 10.0
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not self.site_name:
            raise SettingsError("SITE_NAME must not be empty")
        if not 0 <= self.port < 65536:
            raise SettingsError(
                f"SITE_PORT must be in 0..65535 (0: any free port), got {self.port}"
            )
        if not 0 <= self.metrics_port < 65536 or (
            self.metrics_port != 0 and self.metrics_port == self.port
        ):
            raise SettingsError(
                f"SITE_METRICS_PORT must be in 0..65535 (0: off) and differ from SITE_PORT, "
                f"got {self.metrics_port}"
            )
        if not 0 <= self.http_port < 65536 or (
            self.http_port != 0 and self.http_port in (self.port, self.metrics_port)
        ):
            raise SettingsError(
                f"SITE_HTTP_PORT must be in 0..65535 (0: off) and differ from SITE_PORT and "
                f"SITE_METRICS_PORT, got {self.http_port}"
            )
        if self.http_port and not (self.allow_plaintext or _is_loopback(self.host)):
            raise SettingsError(
                "SITE_HTTP_PORT serves plaintext without keys: on a non-loopback SITE_HOST it "
                "needs SITE_ALLOW_PLAINTEXT=true (a network only the gateway or a proxy reaches)"
            )
        tls = {
            "SITE_TLS_CERT": self.tls_cert,
            "SITE_TLS_KEY": self.tls_key,
            "SITE_TLS_CLIENT_CA": self.tls_client_ca,
        }
        if any(tls.values()) and not all(tls.values()):
            missing = [name for name, path in tls.items() if path is None]
            raise SettingsError(f"TLS needs all of {list(tls)} or none; missing {missing}")
        if self.gateway_identity is not None and not (
            0 < len(self.gateway_identity) <= 253 and self.gateway_identity.isprintable()
        ):
            raise SettingsError("SITE_GATEWAY_IDENTITY must be 1..253 printable characters")
        if not (all(tls.values()) or self.allow_plaintext or _is_loopback(self.host)):
            raise SettingsError(
                f"SITE_HOST={self.host} is not loopback and TLS is not configured: anyone who "
                f"reaches the port could use it. Set {list(tls)} (mutual TLS), or "
                "SITE_ALLOW_PLAINTEXT=true (--allow-plaintext) on a network only the gateway "
                "reaches"
            )
        if self.max_queued_requests < 1:
            raise SettingsError("SITE_MAX_QUEUED_REQUESTS must be >= 1")
        if self.grammar_compile_threads < 1 or not self.grammar_compile_timeout_s > 0:
            raise SettingsError(
                "SITE_GRAMMAR_COMPILE_THREADS must be >= 1, SITE_GRAMMAR_COMPILE_TIMEOUT_S > 0"
            )
        if not 1 <= self.max_loras <= self.max_cpu_loras or not 1 <= self.max_lora_rank <= 64:
            raise SettingsError(
                "SITE_MAX_LORAS must be >= 1 and <= SITE_MAX_CPU_LORAS, SITE_MAX_LORA_RANK in 1..64"
            )
        if self.max_cpu_lora_gib < 0:
            raise SettingsError(f"SITE_MAX_CPU_LORA_GIB must be >= 0, got {self.max_cpu_lora_gib}")
        if self.max_lora_loads < 1:
            raise SettingsError(f"SITE_MAX_LORA_LOADS must be >= 1, got {self.max_lora_loads}")
        if self.lora_kernels not in LORA_KERNELS:
            raise SettingsError(
                f"SITE_LORA_KERNELS must be one of {LORA_KERNELS}, got {self.lora_kernels!r}"
            )
        if self.finetune_reserve_bytes < 0 or self.finetune_checkpoint_every < 1:
            raise SettingsError(
                "SITE_FINETUNE_RESERVE_BYTES must be >= 0 (0: no fine-tuning) and "
                "SITE_FINETUNE_CHECKPOINT_EVERY >= 1"
            )
        if not self.finetune_max_step_ms > 0:
            raise SettingsError("SITE_FINETUNE_MAX_STEP_MS must be > 0")
        if self.finetune_dir_max_bytes < MAX_JOB_FILES_BYTES:
            raise SettingsError(
                f"SITE_FINETUNE_DIR_MAX_BYTES must be at least {MAX_JOB_FILES_BYTES} (the "
                f"files of the largest job a gateway sends), got {self.finetune_dir_max_bytes}"
            )
        if not 0 < self.finetune_busy_share <= 1:
            raise SettingsError("SITE_FINETUNE_BUSY_SHARE must be in (0, 1]")
        if self.finetune_idle_unit_tokens < 1:
            raise SettingsError(
                "SITE_FINETUNE_IDLE_UNIT_TOKENS must be >= 1 (a unit's padded tokens with no "
                f"request in), got {self.finetune_idle_unit_tokens}"
            )
        if self.finetune_mode not in FINETUNE_MODES:
            raise SettingsError(
                f"SITE_FINETUNE_MODE must be one of {FINETUNE_MODES}, got {self.finetune_mode!r}"
            )
        if not self.finetune_max_training_delay_ms > 0:
            raise SettingsError("SITE_FINETUNE_MAX_TRAINING_DELAY_MS must be > 0")
        if self.finetune_reserve_on_demand and not self.finetune_reserve_bytes:
            raise SettingsError("SITE_FINETUNE_RESERVE_ON_DEMAND needs SITE_FINETUNE_RESERVE_BYTES")
        if self.finetune_reserve_bytes and self.lora_dir is None:
            # A job's adapter is served through the site's LoRA slots, which only a site with
            # --lora-dir has: without them a finished job could never be served, and the
            # gateway would wait on it forever.
            raise SettingsError(
                "SITE_FINETUNE_RESERVE_BYTES > 0 needs SITE_LORA_DIR (--lora-dir): a trained "
                "adapter is served through the site's LoRA slots"
            )
        if self.log_level not in LOG_LEVELS:
            raise SettingsError(
                f"SITE_LOG_LEVEL must be one of {LOG_LEVELS}, got {self.log_level!r}"
            )
        if self.task not in TASKS:
            raise SettingsError(f"SITE_TASK must be one of {TASKS}, got {self.task!r}")
        if self.dtype not in DTYPES:
            raise SettingsError(f"SITE_DTYPE must be one of {DTYPES}, got {self.dtype!r}")
        if self.policy not in POLICIES:
            raise SettingsError(f"SITE_POLICY must be one of {POLICIES}, got {self.policy!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise SettingsError(f"SITE_DEVICE must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.lazy_graphs and not self.device.startswith("cuda"):
            raise SettingsError("SITE_LAZY_GRAPHS needs SITE_DEVICE=cuda[:N]: a CPU site has no "
                                "CUDA graphs to capture")  # fmt: skip
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "torch_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SettingsError(f"SITE_{name.upper()} must be >= 1")
        if self.host_kv_cache_gib < 0 or (self.host_kv_cache_gib and not self.prefix_caching):
            raise SettingsError(
                "SITE_HOST_KV_CACHE_GIB must be >= 0, and a host tier needs prefix caching"
            )
        if self.host_kv_offload_bytes_per_step < 1 or self.host_kv_active_window_steps < 0:
            raise SettingsError(
                "SITE_HOST_KV_OFFLOAD_BYTES_PER_STEP must be >= 1, "
                "SITE_HOST_KV_ACTIVE_WINDOW_STEPS >= 0"
            )
        if self.deferral_bound_tokens < 0:
            raise SettingsError("SITE_DEFERRAL_BOUND_TOKENS must be >= 0 (0: no bound)")
        if not 0.0 <= self.deferral_bound_slack <= 10.0:
            raise SettingsError("SITE_DEFERRAL_BOUND_SLACK must be in [0, 10] (0: no time bound)")
        if self.kv_cache_mib < 0 or self.load_report_interval_ms < 10:
            raise SettingsError(
                "SITE_KV_CACHE_MIB must be >= 0, SITE_LOAD_REPORT_INTERVAL_MS >= 10"
            )

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> SiteSettings:
        """Environment first, then explicit overrides (CLI flags); None overrides are ignored."""
        env = os.environ if environ is None else environ
        values = read_env(cls, env)
        values.update({key: value for key, value in overrides.items() if value is not None})
        if "model_dir" not in values:
            raise SettingsError("the model directory is required: SITE_MODEL_DIR or --model")
        values["model_dir"] = Path(values["model_dir"])
        for name in (
            "tokenizer_dir",
            "tls_cert",
            "tls_key",
            "tls_client_ca",
            "lora_dir",
            "finetune_dir",
        ):
            if values.get(name) is not None:
                values[name] = Path(values[name])
        # A CUDA site serves before its graphs exist unless told not to; a CPU site has none.
        values.setdefault("lazy_graphs", str(values.get("device", "cpu")).startswith("cuda"))
        values.setdefault("model_name", default_model_name(values["model_dir"]))
        values.setdefault("site_name", values["model_name"])
        return build(cls, values)

    def with_port(self, port: int) -> SiteSettings:
        return replace(self, port=port)


def default_model_name(model_path: Path) -> str:
    """The directory's name, or its GGUF file's name without the quantization suffix."""
    try:
        gguf = find_gguf(model_path)
    except GgufImportError:
        gguf = None  # the loader reports the ambiguity; a name is no place for it
    return model_name_of(gguf) if gguf is not None else model_path.name


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
