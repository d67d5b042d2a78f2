"""The fitted part of a simulated site: how long one engine step takes, from what the real
scheduler put in it.

time = base + (prefill_base, when the step computes any prompt token)
     + per_prefill_token x prefill tokens + per_decode_row x decode rows
     + per_kv_token x KV tokens read + per_attention x prefill attention pairs
     + (adapter_base + per_adapter x distinct adapters, when any row uses an adapter)

The terms are the roofline's: weights read once a step (base), the launch cost of a step that
prefills (a decode-only step replays a CUDA graph; one with prefill chunks runs the flat step
graph or eagerly: bench/results/engine_serving: a 1B step with ~1,500 prompt tokens took 8 ms on
an H200 against 3 ms for 192 decode rows), the matmul work of each computed
position (prefill tokens, decode rows), the KV each row reads (each row's length after the
step, the scheduler's own `context_tokens`), the quadratic attention of prefill chunks
(new tokens x the positions they attend to), and the LoRA deltas (each distinct adapter's
weights read, its segment's kernels). On another card (fedsim/cards.py) the memory-bound terms
scale by bandwidth, the compute-bound ones by FLOPs.

The engine loop's host time (`HostOverhead`, h = constant + per row): the grid times
`ModelRunner.execute` synchronized, device time plus the runner's host work in series; the engine
with async scheduling prepares step N+1 while the device runs step N, so its period is
max(device, host) = max(grid - h, h). h is fitted on whole `engine.step()` periods (decode_sweep,
step_grid's `--engine-steps`; fedsim/calibrate/host.py); absent (0), the model is the grid's.
It is a CPU's cost, so it does not scale with the card.

A step that admits (a prompt chunk beside the decode rows) adds host time: a constant a step
(`admitting_step_s`), fitted on one measured burst. Before issue 66 the engine's host work grew
with the KV its rows read (`per_kv_token_admitting_s`, kept for the models fitted then: an H200
at ~250 rows took 3.3 ms a step admitting at ~27k KV tokens and 5.4-5.5 ms at 60-65k); issue 66
made a step's host work follow what changed (the rows admitted, not the batch), and on that
engine the per-KV form fitted on the 1,000-request burst put the 3,000/4,500-request bursts
29-68% slow, where a constant fitted on the same burst puts them within 15% (docs/simulator.md,
"The refit after issue 66"). Which part of the loop spends it is not recorded. As host time it
only shows where the host sets the pace (full batches). `loop_scale` (the serving loop's host
time over the sweep's) is 1 unless set.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace

from fedsim.cards import Card
from site_engine.engine.core.types import SchedulerOutput


@dataclass(frozen=True, slots=True)
class StepFeatures:
    prefill_tokens: int
    decode_rows: int
    kv_read_tokens: int
    prefill_attention: int
    adapters: int

    @property
    def rows(self) -> int:
        """Sequences in the step: decode rows plus prefill chunks (counted in prefill_tokens)."""
        return self.decode_rows + (1 if self.prefill_tokens else 0)

    @classmethod
    def of(cls, output: SchedulerOutput) -> StepFeatures:
        """What a step the scheduler planned holds."""
        prefill = attention = 0
        decode = output.num_decodes
        adapters = {seq.adapter for seq in output.decode_seqs if seq.adapter}
        for chunk in output.prefill_chunks:
            n = len(chunk.token_ids)
            if n == 1 and chunk.num_generated > 0:
                decode += 1  # one known token after an answer: a decode row's cost
            else:
                prefill += n
                attention += n * (chunk.start_position + n)
            if chunk.adapter:
                adapters.add(chunk.adapter)
        return cls(prefill, decode, output.context_tokens, attention, len(adapters))


# The terms each side of the roofline scales.
_MEMORY_TERMS = ("base_s", "prefill_base_s", "per_kv_token_s", "adapter_base_s", "per_adapter_s")
_COMPUTE_TERMS = ("per_prefill_token_s", "per_decode_row_s", "per_attention_s")


@dataclass(frozen=True, slots=True)
class HostOverhead:
    """The engine loop's host seconds per step, overlapped by async scheduling (the module
    docstring)."""

    base_s: float = 0.0
    per_row_s: float = 0.0
    # The host time of a serving loop over the decode sweep's (1: not fitted; the docstring).
    loop_scale: float = 1.0
    # Host seconds per KV token read by the rows of a step that admits: the engine before issue
    # 66 (the module docstring); 0 in models fitted since.
    per_kv_token_admitting_s: float = 0.0
    # Host seconds a step that admits adds (the module docstring): fitted on one measured burst
    # (fedsim/calibrate/replay.py's fit_admitting).
    admitting_step_s: float = 0.0

    def seconds(self, f: StepFeatures) -> float:
        return max(self.base_s + self.per_row_s * f.rows, 0.0)

    def period(self, grid_s: float, f: StepFeatures) -> float:
        """The engine's step period where the grid's synchronized step takes `grid_s`: the
        device's part (grid - h) or the host's, whichever is longer."""
        h = min(self.seconds(f), grid_s)
        host = self.loop_scale * h
        if f.prefill_tokens:
            host += self.admitting_step_s + self.per_kv_token_admitting_s * f.kv_read_tokens
        return max(grid_s - h, host)


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Seconds of one step (the module docstring's sum); `card`: the card it was fitted on."""

    card: str
    base_s: float
    per_prefill_token_s: float
    per_decode_row_s: float
    per_kv_token_s: float
    per_attention_s: float = 0.0
    prefill_base_s: float = 0.0
    adapter_base_s: float = 0.0
    per_adapter_s: float = 0.0
    host: HostOverhead = HostOverhead()

    def seconds(self, f: StepFeatures) -> float:
        t = (
            self.base_s
            + self.per_prefill_token_s * f.prefill_tokens
            + self.per_decode_row_s * f.decode_rows
            + self.per_kv_token_s * f.kv_read_tokens
            + self.per_attention_s * f.prefill_attention
        )
        if f.prefill_tokens:
            t += self.prefill_base_s
        if f.adapters:
            t += self.adapter_base_s + self.per_adapter_s * f.adapters
        return self.host.period(t, f)

    def on(self, fitted_on: Card, card: Card) -> StepTimeModel:
        """The same model on `card`: memory terms x bandwidth ratio, compute x FLOPs ratio."""
        memory = fitted_on.bandwidth_bytes_s / card.bandwidth_bytes_s
        compute = fitted_on.bf16_flops / card.bf16_flops
        scaled = {name: getattr(self, name) * memory for name in _MEMORY_TERMS}
        scaled |= {name: getattr(self, name) * compute for name in _COMPUTE_TERMS}
        return replace(self, card=card.name, **scaled)

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> StepTimeModel:
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown step-time terms {sorted(unknown)}")
        values = dict(data)
        host = values.pop("host", None)
        if host is not None:
            if not isinstance(host, dict):
                raise ValueError(f"host overhead must be an object, not {host!r}")
            values["host"] = HostOverhead(**host)
        return cls(**values)  # type: ignore[arg-type]


COEFFICIENTS = (
    "base_s",
    "per_prefill_token_s",
    "per_decode_row_s",
    "per_kv_token_s",
    "per_attention_s",
    "prefill_base_s",
    "adapter_base_s",
    "per_adapter_s",
)


def design_row(f: StepFeatures) -> list[float]:
    """The step's value of each coefficient's feature, in COEFFICIENTS' order."""
    any_adapter = 1.0 if f.adapters else 0.0
    return [
        1.0,
        float(f.prefill_tokens),
        float(f.decode_rows),
        float(f.kv_read_tokens),
        float(f.prefill_attention),
        1.0 if f.prefill_tokens else 0.0,
        any_adapter,
        float(f.adapters),
    ]


def model_from(card: str, values: Sequence[float]) -> StepTimeModel:
    terms: dict[str, float] = dict(zip(COEFFICIENTS, values, strict=True))
    return StepTimeModel(card, **terms)  # type: ignore[arg-type]  # host keeps its default
