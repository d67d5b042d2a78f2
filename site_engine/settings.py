"""Site engine settings: read once from environment variables (SITE_*), overridable by the flags
derived from the same fields (`python -m site_engine --help`)."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from fedllm_contract.env_settings import SettingsError, build, read_env, setting
from fedllm_contract.fine_tuning import MAX_JOB_FILES_BYTES
from site_engine.engine.core.scheduling_policy import POLICY_NAMES, PolicyName
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
    """A site's settings: each field a `SITE_*` variable and a flag of `python -m site_engine`
    (`add_flags`, fedllm_contract/env_settings.py), its help the flag's and docs/configuration.md's
    table's."""

    ENV_PREFIX: ClassVar[str] = "SITE_"

    model_dir: Path = setting(
        help="transformers model dir, a GGUF file, or a dir holding one (converted once, cached)",
        flag="--model",
    )
    site_name: str = setting(help="the site's name", shown_default="`SITE_MODEL_NAME`")
    model_name: str = setting(
        help="the name the gateway routes by", shown_default="the model directory's name"
    )
    tokenizer_dir: Path | None = setting(
        None, help="the tokenizer's directory", shown_default="the model's", flag="--tokenizer"
    )
    task: Task = setting(
        "auto",
        help="`generate`, `embed`, or `auto`: an embedding model when the model directory is a "
        "sentence-transformers one (a `modules.json` with a Pooling module), else generative "
        "([openai-api.md](openai-api.md#embeddings-post-v1embeddings)); for an embedding model "
        "`SITE_MAX_NUM_SEQS` and `SITE_MAX_NUM_BATCHED_TOKENS` bound the inputs and padded "
        "tokens of one forward pass",
    )
    host: str = setting("127.0.0.1", help="the gRPC server's address")
    port: int = setting(50051, help="the gRPC port (0: any free port)")
    device: str = setting("cpu", help="`cpu` or `cuda[:N]`")
    dtype: str = setting("float32", help="`float32`, `bfloat16` or `float16`")
    max_num_seqs: int | None = setting(
        None,
        help="sequences running at once (an embedding model: inputs of one forward pass)",
        shown_default="by device: 16 on CPU, vLLM's for a GPU's memory (logged)",
    )
    max_num_batched_tokens: int | None = setting(
        None,
        help="tokens one step computes at most (an embedding model: padded tokens of one pass)",
        shown_default="by device: 2,048 on CPU, vLLM's for a GPU's memory (logged)",
    )
    block_size: int = setting(16, help="tokens per KV cache block")
    kv_cache_mib: int = setting(
        0,
        help="the KV cache's budget in MiB; 0: the memory left after a trial of the largest "
        "step, the CUDA graphs and the sampler on a GPU ([engine-gpu.md](engine-gpu.md)), a "
        "default on CPU",
    )
    policy: PolicyName = setting(
        "fcfs", help="the waiting queue's order: `fcfs`, `spf` (with aging) or `static` batches"
    )
    deferral_bound_tokens: int = setting(
        512,
        help="the deferral bound on background work: prefill tokens of flex and batch requests "
        "per engine step at most, so an interactive request arriving mid-step waits at most one "
        "step with that much background in it before it joins (in seconds: this over "
        "`fedllm_site_prefill_tokens_per_second`); 0: no bound "
        "([engine.md](engine.md#priority-classes))",
    )
    deferral_bound_slack: float = setting(
        0.15,
        help="the deferral bound's time side: while interactive requests run, background rows "
        "(decodes too) may add at most this fraction of the predicted time of a step's "
        "interactive part, the step cost learned from the steps run; 0: the token bound alone "
        "([engine.md](engine.md#priority-classes))",
    )
    prefix_caching: bool = setting(
        True,
        help="automatic prefix caching: full KV blocks are kept by a chained id of their tokens, "
        "the model and the request's cache salt, shared by later prompts that start the same "
        "way, and evicted least-recently-used ([engine.md](engine.md#prefix-caching))",
    )
    # `load` turns it on for a CUDA site unless told (tests/gpu/test_lazy_graphs.py passed on
    # an H100).
    lazy_graphs: bool = setting(
        False,
        help="CUDA only (`true` is refused on CPU): serve at once, before any CUDA graph exists "
        "(steps without their graph run eagerly), and capture the graphs between steps; "
        "`false` captures them all before READY "
        "([elastic.md](elastic.md#serving-before-graphs-lazy-graphs))",
        shown_default="`true` on CUDA, `false` on CPU",
    )
    host_kv_cache_gib: float = setting(
        0.0,
        help="host memory (GiB; pinned on CUDA) for the prefix cache's second tier: blocks about "
        "to be evicted from the device that are likely to be read again (hit before, or of a "
        "conversation still active) are copied there, on a side stream overlapping the steps, "
        "and copied back when a prompt needs them ([engine.md](engine.md#prefix-caching))",
    )
    host_kv_offload_bytes_per_step: int = setting(
        32 << 20,
        help="the host tier's bandwidth share: bytes of copies to it decided per engine step at "
        "most (whole blocks; at least one block's worth); a block worth a copy beyond it is "
        "simply evicted (`fedllm_site_host_kv_offload_skipped_blocks_total`)",
    )
    host_kv_active_window_steps: int = setting(
        2000,
        help="a finished (or preempted) request's blocks count as of a conversation still "
        "active, worth a host copy, for this many engine steps after it left; 0: only blocks "
        "hit before are copied",
    )
    load_report_interval_ms: int = setting(
        500, help="period of the load reports the site pushes to the gateway"
    )
    # Several sites often share one host in tests and demos; more threads than free cores makes
    # every step slower (measured: 38 ms vs 5 ms per token).
    torch_threads: int = setting(1, help="CPU intra-op threads")
    switch_interval_us: float = setting(
        500.0,
        help="the site process's interpreter switch interval: at most how long its engine thread "
        "waits for the GIL its event loop holds, which it lets go in every NumPy call over more "
        "than 500 rows (`python -m bench.serving_path.gil_handoff`: 50 cuts that wait on a "
        "GPU host; CPython's default is 5,000)",
    )
    metrics_port: int = setting(0, help="Prometheus metrics over HTTP on this port; 0: off")
    http_port: int = setting(
        0,
        help="the OpenAI-compatible HTTP face (`/v1/completions`, `/v1/chat/completions`, or "
        "`/v1/embeddings` for an embedding model, `/v1/models`, `/metrics` in vLLM's names) next "
        "to gRPC; 0: off; plaintext without keys, so off loopback it needs "
        "`SITE_ALLOW_PLAINTEXT` ([external-engines.md](external-engines.md))",
    )
    tls_cert: Path | None = setting(None, help="the site's PEM certificate chain")
    tls_key: Path | None = setting(None, help="its private key")
    tls_client_ca: Path | None = setting(
        None,
        help="the CA that signs client (gateway) certificates; with all three set the gRPC port, "
        "health service included, serves only mutual TLS; all three or none",
    )
    # The CA signs every site's certificate too (the health probe's), so the CA alone does not
    # say "gateway".
    gateway_identity: str | None = setting(
        None,
        help="the gateway's name in its client certificate (common name or a DNS name, e.g. "
        "`<name_prefix>-gateway`): over mutual TLS only a client presenting it may call the KV "
        "lending RPCs (`KvRoom`, `LendKv`, `ReturnKv`, `RenewKvLease`; "
        "[elastic.md](elastic.md#leases)); unset, no TLS client may; over plaintext only a "
        "caller on loopback may",
    )
    # Plaintext on a non-loopback host lets anyone who reaches the port generate for free and
    # release or cancel others' queued requests: refused unless overridden with this.
    allow_plaintext: bool = setting(
        False,
        help="serve plaintext on a non-loopback `SITE_HOST`; without it such a site refuses to "
        "start unless the three `SITE_TLS_*` are set (loopback needs neither)",
    )
    max_queued_requests: int = setting(
        1024,
        help="requests waiting for a batch slot; one more gets `RESOURCE_EXHAUSTED`, and the "
        "gateway tries another site of the model, else answers 503 with `Retry-After` (the "
        "site stays healthy)",
    )
    grammar_compile_threads: int = setting(
        2,
        help="threads compiling new schemas' grammars, off the engine's step loop: a request "
        "waits for its grammar while every other one steps ([security.md](security.md), "
        '"Structured outputs")',
    )
    grammar_compile_timeout_s: float = setting(
        5.0,
        help="a grammar compiling longer fails its requests with `INVALID_ARGUMENT` (a 400 from "
        "the gateway)",
    )
    lora_dir: Path | None = setting(
        None,
        help="a directory of PEFT LoRA adapters (`adapter_config.json` + "
        "`adapter_model.safetensors` each), served under their directories' names; an adapter "
        "that does not fit the base (layers, shapes, rank above `SITE_MAX_LORA_RANK`) or uses a "
        "PEFT feature the engine does not serve as peft does (DoRA, aLoRA, layer_replication, "
        "biases, per-module ranks...), or whose weights hold NaN, infinite values or values past "
        "the serving dtype's range, fails its requests with the reason; no `lora_alpha` means "
        "peft's 8. CPU and CUDA (segmented Triton kernels inside the CUDA graphs; "
        "[engine.md](engine.md#lora-adapters))",
    )
    max_loras: int = setting(
        4,
        help="distinct adapters running at once (the device's adapter slots); a request of "
        "another adapter waits while others run",
    )
    max_cpu_loras: int = setting(
        8,
        help="adapters kept loaded in host memory, least recently used evicted (never one a live "
        "request uses); a missing one loads on a worker thread while the engine steps on",
    )
    max_cpu_lora_gib: float = setting(
        0.0,
        help="host memory the adapters kept there may take at most (GiB, pinned on CUDA): least "
        "recently used evicted first, never one a live request uses; 0: `SITE_MAX_CPU_LORAS` "
        "alone bounds them",
    )
    max_lora_rank: int = setting(
        16, help="the largest adapter rank served (at most 64); every slot is padded to it"
    )
    max_lora_loads: int = setting(
        4,
        help="adapters read from disk at once, each on its own worker thread, started when "
        "their first request arrives (in arrival order beyond this many); a request waits for "
        "its own adapter's load only. One makes cold adapters queue behind each other (the "
        "H100 1,000-adapter run: TTFT p99 7.3 s)",
    )
    # Off by default: the slot tensors are still allocated at the cap beside the cache.
    lora_unified_slots: bool = setting(
        False,
        help="adapter slots out of the KV cache's block pool (issue 69, S-LoRA's unified "
        "paging): `SITE_MAX_LORAS` is then a cap, each resident adapter holds its bytes' worth "
        "of KV blocks, and idle ones give them back when sequences need them "
        "([engine.md](engine.md), LoRA)",
    )
    finetune_reserve_bytes: int = setting(
        0,
        help="device memory reserved for LoRA fine-tuning jobs (LoRA weights, their gradients "
        "and AdamW state, one micro-batch's activations), taken from the KV cache's budget at "
        "start; 0: the site takes no jobs (StartFineTune answers FAILED_PRECONDITION); > 0 "
        "needs `SITE_LORA_DIR` (the trained adapter is served through its LoRA slots) "
        "([engine.md](engine.md#fine-tuning-jobs))",
    )
    finetune_reserve_on_demand: bool = setting(
        False,
        help="`true`: the KV cache is planned at full size and the reserve is taken from its top "
        "only while a job trains (drained first if sequences hold it), given back when none "
        "does; needs `SITE_FINETUNE_RESERVE_BYTES` ([engine.md](engine.md#fine-tuning-jobs))",
    )
    finetune_dir: Path = setting(
        Path("var/finetune"),
        help="where jobs, their checkpoints and final adapters live; unfinished jobs found "
        "there at start resume from their last checkpoint. An ended job keeps only its "
        "description, its result and (succeeded) its adapter: its files and checkpoints are "
        "cleared on cancel, failure and success",
    )
    finetune_dir_max_bytes: int = setting(
        8 << 30,
        help="what `SITE_FINETUNE_DIR` may hold: a job whose files would take it past is refused "
        "at its start; an ended job's files and checkpoints are cleared (at least one job's "
        "largest files)",
        shown_default="8 GiB",
    )
    finetune_checkpoint_every: int = setting(10, help="optimizer steps between a job's checkpoints")
    finetune_max_step_ms: float = setting(
        200.0,
        help="the time one unit of training (a token-bounded micro-batch's forward and "
        "backward) may hold the engine's loop while requests run: units are then sized to it "
        "from the measured seconds per token, and one starts only if it is predicted to end "
        "within it (one example longer than that runs only with no request in). Every unit, an "
        "idle-sized one too, runs in pieces cut to it (at layer boundaries, between loss "
        "chunks, before the optimizer step)",
    )
    # The same 15% that background rows may add to an interactive step (deferral_bound_slack).
    finetune_busy_share: float = setting(
        DEFAULT_BUSY_SHARE,
        help="while requests run, the most of the engine's time training units may take: a unit "
        "waits (1 - share) / share times its predicted length after the last one ended (1: a "
        "unit between every two steps)",
    )
    finetune_idle_unit_tokens: int = setting(
        4096,
        help="with no request waiting or running, a unit of training takes up to this many "
        "padded tokens (8 x 512; the reserve caps it too) with no time bound: thousands of "
        "tokens a step, as a plain training loop runs. Its pieces still hand the engine's loop "
        "back within `SITE_FINETUNE_MAX_STEP_MS`, so a request arriving meanwhile waits for one "
        "piece, not for the unit ([engine.md](engine.md#fine-tuning-jobs))",
    )
    # A job that waits for idle time starves under steady chat: continuous batching almost
    # never leaves a whole step idle (site_engine/finetune/step_work.py). Rows by default since
    # issue 76: on an H200 beside chat at 0.6x load, 0.44 of the job's speed alone with chat's
    # TPOT p99 within 1.0x, where idle units reached 0.07 (bench/results/finetune_colocated/).
    finetune_mode: FineTuneMode = setting(
        "rows",
        help="how training shares the engine with serving: `idle` runs units between steps, "
        "paced by `SITE_FINETUNE_BUSY_SHARE` while requests run; `rows` runs a bounded piece of "
        "the job with every step, sized to the room the serving batch leaves in the step's "
        "token budget and to `SITE_FINETUNE_MAX_TRAINING_DELAY_MS`, none while a request waits "
        "for room (issues 70, 76: [engine.md](engine.md#fine-tuning-jobs))",
    )
    finetune_max_training_delay_ms: float = setting(
        10.0,
        help="`rows` mode: the most a step's training piece may delay it; pieces are sized to "
        "half of it from the last one's measured time (`SITE_FINETUNE_MAX_STEP_MS` does not "
        "apply then)",
    )
    log_level: str = setting(
        "INFO", help="`DEBUG`, `INFO`, `WARNING` or `ERROR`; the site never logs prompts"
    )

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
        if not 1.0 <= self.switch_interval_us <= 100_000.0:
            raise SettingsError("SITE_SWITCH_INTERVAL_US must be in [1, 100000]")
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
