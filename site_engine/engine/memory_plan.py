"""How a GPU engine's numbers are chosen: batch limits from the device, the KV cache from what a
trial measured, and the start-up report. Pure arithmetic (no torch), unit-tested on the CPU; the
measurements come from site_engine/engine/memory_trial.py.

The KV cache takes what is left of the device's free memory once everything else the engine will
ever hold is set aside: the largest step's activations and the sampler's temporaries at
max_num_seqs rows (both measured by running them), the CUDA graphs' memory pool (measured on the
largest graph of each kind: the smaller ones share its pool) and their driver-side memory (an
allowance per graph), and a reserve share of the device for the allocator's fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
MIB = 1 << 20
# vLLM's defaults for an OpenAI server (EngineArgs.get_batch_defaults): GPUs of 70 GiB or more
# except the A100 (large budgets measured slower there) get 1,024 sequences and 8,192 tokens a
# step, smaller ones 256 and 2,048.
_LARGE_GPU_BYTES = 70 * GIB
LARGE_GPU_DEFAULTS = (1024, 8192)
SMALL_GPU_DEFAULTS = (256, 2048)
CPU_DEFAULTS = (16, 2048)
# Share of the device kept free for the allocator (fragmentation, the odd unmeasured tensor).
RESERVE_SHARE = 0.05
# Driver-side memory of one instantiated CUDA graph, per decoder layer (H100: ~2-3.5 MiB per
# graph of a 16-layer model, bench/results/engine_prefill/engine_prefill_long_h100_notes.md).
GRAPH_BYTES_PER_LAYER = 256 << 10
# The most blocks a cache may hold: block ids are int32 wherever a kernel reads them (the block
# tables of the Triton kernels and of the CUDA graphs, cuDNN's page tables), and the cache holds
# one block more than the scheduler hands out (the graphs' scratch block, id num_blocks). Element
# offsets are 64-bit in every kernel (docs/engine-gpu.md, "KV offsets"), so this is the only bound.
MAX_BLOCKS = (1 << 31) - 1


@dataclass(frozen=True, slots=True)
class BatchDefaults:
    max_num_seqs: int
    max_num_batched_tokens: int
    reason: str


def batch_defaults(device_type: str, total_bytes: int = 0, device_name: str = "") -> BatchDefaults:
    """max_num_seqs and max_num_batched_tokens when the operator gave none (vLLM's choice)."""
    if device_type != "cuda":
        return BatchDefaults(*CPU_DEFAULTS, "CPU defaults")
    size = f"{device_name or 'GPU'} with {total_bytes / GIB:.0f} GiB"
    if total_bytes >= _LARGE_GPU_BYTES and "a100" not in device_name.lower():
        return BatchDefaults(*LARGE_GPU_DEFAULTS, f"vLLM's defaults for a {size} (>= 70 GiB)")
    return BatchDefaults(*SMALL_GPU_DEFAULTS, f"vLLM's defaults for a {size}")


@dataclass(frozen=True, slots=True)
class TrialMeasurement:
    """What the trial measured, in bytes."""

    total: int  # the device's memory
    free: int  # free on the device after the trial was cleaned up (weights already loaded)
    weights: int  # allocated by this process before the engine (the model)
    step_and_sampler: int  # peak above the trial's start: largest step, sampler, graph pools
    graph_driver: int  # instantiated graphs' memory outside torch's allocator, all graphs
    graphs: int  # number of CUDA graphs the engine will capture


@dataclass(frozen=True, slots=True)
class KvPlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    measurement: TrialMeasurement | None
    reserve: int
    # Blocks the free memory held when MAX_BLOCKS capped the automatic size (0: not capped).
    uncapped_blocks: int = 0

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def full_length_sequences(self) -> int:
        """Sequences of max_model_len tokens the cache holds at once."""
        return self.num_blocks // blocks_for(self.max_model_len, self.block_size)


class KvCacheTooSmall(ValueError):
    """The settings leave too little memory for a KV cache that holds one full sequence."""


class KvCacheUnindexable(ValueError):
    """An explicit KV cache size of more blocks than the kernels can index (MAX_BLOCKS)."""


def _indexable(blocks: int, bytes_per_block: int, requested_bytes: int) -> int:
    """`blocks` if the kernels can index them; an explicit size beyond is refused."""
    if blocks <= MAX_BLOCKS:
        return blocks
    if requested_bytes > 0:
        raise KvCacheUnindexable(
            f"a KV cache of {_gib(requested_bytes)} is {blocks:,} blocks of {bytes_per_block} "
            f"bytes, but the kernels index at most {MAX_BLOCKS:,} blocks (block ids are int32 in "
            "their block tables and cuDNN's page tables, one id kept for the CUDA graphs' "
            f"scratch block): give at most {_gib(MAX_BLOCKS * bytes_per_block)}, or a larger "
            "block size"
        )
    return MAX_BLOCKS


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def plan_kv_cache(
    measurement: TrialMeasurement,
    *,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    requested_bytes: int = 0,
    reserve_share: float = RESERVE_SHARE,
    training_bytes: int = 0,
) -> KvPlan:
    """Blocks of the KV cache from a trial; raises KvCacheTooSmall naming the numbers when the
    automatic cache cannot hold one max_model_len sequence, or `requested_bytes` does not fit
    next to what the engine needs besides."""
    reserve = int(measurement.total * reserve_share)
    # Fine-tuning's reserve (SITE_FINETUNE_RESERVE_BYTES) is the engine's like its step's.
    needs = measurement.step_and_sampler + measurement.graph_driver + training_bytes
    available = measurement.free - needs - reserve
    one_sequence = blocks_for(max_model_len, block_size) * bytes_per_block
    if requested_bytes > 0:
        if requested_bytes > measurement.free - needs:
            raise KvCacheTooSmall(
                f"a KV cache of {_gib(requested_bytes)} does not fit: "
                f"{_breakdown(measurement, needs, 0)} leave {_gib(measurement.free - needs)}; "
                "lower the KV cache size, max_num_seqs or max_num_batched_tokens"
            )
        blocks = requested_bytes // bytes_per_block
    else:
        blocks = max(available, 0) // bytes_per_block
    indexable = _indexable(blocks, bytes_per_block, requested_bytes)
    plan = KvPlan(indexable, block_size, bytes_per_block, max_model_len, measurement, reserve,
                  uncapped_blocks=blocks if indexable < blocks else 0)  # fmt: skip
    # An explicit size smaller than one full sequence is the operator's choice (tests use one
    # to force preemption; the scheduler refuses requests that could never fit it).
    if requested_bytes <= 0 and blocks * bytes_per_block < one_sequence:
        fits = blocks * block_size
        raise KvCacheTooSmall(
            f"to serve one sequence of the model's max length ({max_model_len:,} tokens) the KV "
            f"cache needs {_gib(one_sequence)}, but it gets {_gib(blocks * bytes_per_block)} "
            f"({fits:,} tokens): {_breakdown(measurement, needs, reserve)}. Lower "
            "max_num_batched_tokens or max_num_seqs, give a larger KV cache size, or use a "
            f"model of at most {fits:,} positions"
        )
    return plan


def plan_from_budget(
    budget_bytes: int, *, bytes_per_block: int, block_size: int, max_model_len: int
) -> KvPlan:
    """An explicit budget with no trial (CPU, or a KV size given on a device with no trial)."""
    blocks = budget_bytes // bytes_per_block
    if blocks < 1:
        raise KvCacheTooSmall(
            f"a KV budget of {budget_bytes / MIB:.1f} MiB holds no block of {bytes_per_block} bytes"
        )
    blocks = _indexable(blocks, bytes_per_block, budget_bytes)
    return KvPlan(blocks, block_size, bytes_per_block, max_model_len, None, 0)


def _gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB"


def _breakdown(m: TrialMeasurement, needs: int, reserve: int) -> str:
    parts = [
        f"the device has {_gib(m.total)}, {_gib(m.free)} free with the weights "
        f"({_gib(m.weights)}) loaded",
        f"the largest step, the sampler and the CUDA graph pool take {_gib(m.step_and_sampler)}",
        f"{m.graphs} CUDA graphs {_gib(m.graph_driver)} more",
    ]
    if reserve:
        parts.append(f"the reserve ({RESERVE_SHARE:.0%} of the device) {_gib(reserve)}")
    return ", ".join(parts)


def startup_report(plan: KvPlan, graphs: str) -> str:
    """The one log line a site prints once its engine is built."""
    line = (
        f"KV cache: {plan.num_blocks:,} blocks of {plan.block_size} tokens = {plan.tokens:,} "
        f"tokens, {_gib(plan.kv_bytes)}; {plan.full_length_sequences:,} sequence(s) of "
        f"max_model_len {plan.max_model_len:,} fit at once; {graphs}"
    )
    if plan.uncapped_blocks:
        line += (
            f"; capped from {plan.uncapped_blocks:,} blocks at the {MAX_BLOCKS:,} the kernels "
            "index (int32 block ids)"
        )
    m = plan.measurement
    if m is not None:
        line += (
            f"; device {_gib(m.total)}: weights {_gib(m.weights)}, largest step + sampler + "
            f"graph pool {_gib(m.step_and_sampler)}, graph driver memory {_gib(m.graph_driver)}, "
            f"reserve {_gib(plan.reserve)}"
        )
    return line
