"""Step time with grammar masks: batches of free and constrained requests against the same
batches free only, on the engine as sites run it (paged KV cache, CUDA graphs, async steps).

For each batch size the same requests run twice: "none" (every request free) and "mixed" (every
other request constrained to a JSON schema clients send: bench/structured/schemas.py, plus any
JSON object and a Hermes tool call). Timed: every decode step while the whole batch runs (so
both runs time steps of the same rows), from schedule to the sampled tokens on the host. The
mask overhead is mixed / none - 1 (goal: <= 10% of the step). Checked: the free requests'
greedy tokens are the same in both runs (masks touch constrained rows only).

The model: random weights (seeded) of Llama-3.2-1B's shape (--shape 1b, the GPU default),
Llama-3.1-8B's (--shape 8b) or a two-layer one (--shape small, the CPU preset), its vocabulary
the tokenizer's, so masks are as wide as that tokenizer's: SmolLM2's (49,152 tokens) or Qwen2's
(151,643, wider than Llama-3's 128,256). A 1B model's decode step is mostly host work at these
batches, so every host microsecond the masks add shows; an 8B model's is mostly GPU work, which
the mask work overlaps (it runs while the step's forward does). Results:
bench/results/structured_output/structured_output_<device>[_<shape>].

    python -m bench.engine.structured_output --tokenizer var/models/SmolLM2-135M-Instruct-*
    python -m bench.engine.structured_output --shape 8b --tokenizer ../shared/tokenizers/qwen2
    python -m bench.engine.structured_output --preset cpu --tokenizer ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, results_dir
from bench.engine.model_setup import LLAMA_1B_SHAPE, LLAMA_8B_SHAPE, SMALL_SHAPE, build_model_dir
from fedllm_contract.grammar import ConstraintSpec
from site_engine.engine.core.api import EngineRequest
from site_engine.engine.core.types import SamplingParams
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.model_loading import LoadedModel, load_model

RESULTS = results_dir("structured_output")
PROMPT = "Extract the fields of this record as JSON: name, city, age, tags and notes.\n"
TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "properties": {"city": {"type": "string"}},
                      "required": ["city"]},
    },
    "required": ["name", "arguments"],
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Preset:
    shape: str
    batches: tuple[int, ...]
    max_tokens: int
    dtype: str


SHAPES: dict[str, dict[str, Any]] = {
    "1b": LLAMA_1B_SHAPE,
    # 8,192 positions (the rope scaling's original length): the answers are short, the rope
    # variant does not change a step's cost, and 131,072 would size the memory trial for nothing.
    "8b": {**LLAMA_8B_SHAPE, "max_position_embeddings": 8192},
    "small": SMALL_SHAPE,
}
PRESETS = {
    "gpu": Preset("1b", (64, 256), 64, "bfloat16"),
    "cpu": Preset("small", (8, 16), 24, "float32"),
}


def client_schemas() -> dict[str, Any]:
    """bench/structured/client_schemas.json, read without importing pydantic."""
    path = Path(__file__).resolve().parents[1] / "structured" / "client_schemas.json"
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def constraints() -> list[ConstraintSpec]:
    specs = [
        ConstraintSpec("json_schema", schema=json.dumps(schema, sort_keys=True))
        for schema in client_schemas().values()
    ]
    specs.append(ConstraintSpec("json_object"))
    specs.append(
        ConstraintSpec(
            "tagged_json",
            schema=json.dumps(TOOL_CALL),
            begin="<tool_call>\n",
            end="\n</tool_call>",
            max_items=1,
        )
    )
    return specs


def request(loaded: LoadedModel, index: int, max_tokens: int, constrained: bool) -> EngineRequest:
    specs = constraints()
    prompt = tuple(loaded.tokenizer.encode(PROMPT, add_special_tokens=False)) + tuple(
        loaded.tokenizer.encode(f" Record {index}.", add_special_tokens=False)
    )
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=not constrained,  # free rows run their full length
        constraint=specs[index // 2 % len(specs)] if constrained else None,
    )
    return EngineRequest(f"r{index}", prompt, sampling)


def slot_request(
    loaded: LoadedModel,
    index: int,
    max_tokens: int,
    mixed: bool,
    matched: dict[str, int] | None,
) -> EngineRequest:
    """Request `index` of a run: odd ones constrained in a mixed run; in a matched run free,
    ending where the mixed run's constrained answer of that index ended."""
    if matched is None or index % 2 == 0:
        return request(loaded, index, max_tokens, mixed and index % 2 == 1)
    return request(loaded, index, matched.get(f"r{index}", max_tokens), False)


def fill_masks_inline(engine: PagedEngine) -> None:
    """Makes `engine` fill its masks on its own thread, as before the sampler's filler."""
    runner = engine._runner
    fill_here = type(runner).prepare_masks
    runner.prepare_masks = lambda step, background=False: fill_here(runner, step, False)  # type: ignore[method-assign]


def _sync(loaded: LoadedModel) -> None:
    if loaded.device.type == "cuda":
        torch.cuda.synchronize(loaded.device)


class PhaseClock:
    """Host wall time per phase of `PagedEngine.step`, by wrapping the engine's parts (the
    scheduler's and runner's methods on the instances, the mask fill and the wait for sampled
    tokens where they are defined): where a step with constrained rows spends its extra."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, phase: str) -> None:
        original = getattr(owner, name)
        totals = self.totals

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[phase] = totals.get(phase, 0.0) + time.perf_counter() - start

        self._undo.append((owner, name, original))
        setattr(owner, name, timed)

    def attach(self, engine: PagedEngine) -> None:
        from site_engine.engine import host_staging, launched_step, sampler, structured_output

        scheduler, runner = engine._scheduler, engine._runner
        self.wrap(sampler, "apply_grammar_masks", "masks (filled and applied)")
        self.wrap(host_staging.HostStaging, "to_device", "host-to-device copies")
        self.wrap(scheduler, "schedule", "schedule")
        self.wrap(scheduler, "advance_guides", "advance grammars")
        self.wrap(scheduler, "update", "update")
        self.wrap(runner, "launch_logits", "launch model")
        self.wrap(runner, "sample", "sample (masks included)")
        self.wrap(structured_output, "fill_masks", "fill masks (inline)")
        self.wrap(runner, "prepare_masks", "prepare masks (fill begun or done)")
        self.wrap(structured_output.MaskFiller, "wait", "wait for the filler thread")
        self.wrap(launched_step.LaunchedStep, "result", "wait for tokens")

    def detach(self) -> None:
        for owner, name, original in reversed(self._undo):
            if isinstance(owner, (type, types.ModuleType)):
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # the instance attribute hid the class's method
        self._undo.clear()


def run(
    loaded: LoadedModel,
    config: EngineConfig,
    batch: int,
    max_tokens: int,
    mixed: bool,
    inline: bool = False,
    matched: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One run: decode step times while the whole batch runs, and every request's tokens.

    A constrained answer ends at its JSON's end, long before the free rows' `max_tokens`: each
    one that finishes is replaced by a new constrained request (the next schema, odd index) as
    long as free rows run, so the mixed batch stays half constrained for as many steps as the
    free one runs, grammars at every stage of their answers as on a serving site, not only
    their first tokens.

    `inline`: the masks fill on the engine's own thread, not the sampler's filler thread (the
    engine's way before it had one), to compare the two in one run.

    `matched` (a mixed run's constrained answer lengths, by request id): the baseline without
    masks that runs the same batch shapes. The odd rows are free but end after as many tokens
    as the mixed run's constrained answers did and are replaced the same way, so its steps
    prefill the same new requests at the same steps: without it the mixed run's replacement
    prefills would count as mask overhead."""
    engine = PagedEngine(loaded, config)
    if inline:
        fill_masks_inline(engine)
    if mixed:
        # The token trie is built once per site, at start-up; the schemas are compiled ahead
        # too (off the step loop, a new one would keep its request waiting a few steps and
        # change the batches the two runs compare).
        for spec in constraints():
            engine.grammars().guide(spec)
    clock = PhaseClock()
    clock.attach(engine)
    replaced = mixed or matched is not None
    for index in range(batch):
        engine.add_request(slot_request(loaded, index, max_tokens, mixed, matched))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(batch)}
    free_left = {f"r{i}" for i in range(batch) if not (replaced and i % 2 == 1)}
    next_index = batch + 1  # odd: constrained, as in slot_request()
    # Free tokens each free row had when the batch first changed (a constrained row finished):
    # later steps run other batch shapes, whose kernels round bf16 differently, so only the
    # tokens before it can be compared with the free run's.
    stable: int | None = None
    times: list[float] = []
    timed: dict[str, float] = {}  # host time per phase in the timed steps
    _sync(loaded)
    while engine.has_unfinished():
        waiting, running = engine.queue_lengths()
        before = dict(clock.totals)
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        full = waiting == 0 and running == batch and len(outputs) == batch
        if full and all(o.finish_reason is None for o in outputs):
            times.append(elapsed)
            for phase, total in clock.totals.items():
                timed[phase] = timed.get(phase, 0.0) + total - before.get(phase, 0.0)
        for output in outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason is None:
                continue
            free_left.discard(output.request_id)
            constrained = replaced and int(output.request_id[1:]) % 2 == 1
            if constrained and stable is None:
                stable = min(len(tokens[f"r{i}"]) for i in range(0, batch, 2))
            if constrained and free_left:
                engine.add_request(slot_request(loaded, next_index, max_tokens, mixed, matched))
                next_index += 2
    clock.detach()
    compiled = engine.grammars().compiled if mixed else 0
    engine.close()
    steps = times[2:]  # the first steps after prefill warm the graphs and allocator
    return {
        "mixed": mixed,
        "batch": batch,
        "timed_steps": len(steps),
        "step_ms_median": statistics.median(steps) * 1000 if steps else None,
        "step_ms_mean": statistics.fmean(steps) * 1000 if steps else None,
        "constrained_answers": (next_index - batch - 1) // 2 + batch // 2 if mixed else 0,
        "answer_lengths": {rid: len(ids) for rid, ids in tokens.items() if int(rid[1:]) % 2},
        "grammars_compiled": compiled,
        "tokens": tokens,
        "stable_tokens": stable,
        # Over the timed steps (all of them, the two warm-up ones included): the phases of
        # the steps the median is taken over, not of the batch's tail.
        "phases_ms_per_step": {k: v * 1000 / len(times) for k, v in timed.items()} if times else {},
    }


def _ratio(a: dict[str, Any] | None, b: dict[str, Any]) -> float | None:
    if a is None or not a["step_ms_median"] or not b["step_ms_median"]:
        return None
    return float(a["step_ms_median"] / b["step_ms_median"] - 1)


def compare(
    none: dict[str, Any],
    mixed: dict[str, Any],
    matched: dict[str, Any],
    inline: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The mask overhead: the mixed run's step over the matched run's (no masks, the same
    batch shapes), the goal's measure; over the plain free run's too (which has no
    replacement prefills, so that figure also counts them)."""
    free = [rid for rid in none["tokens"] if int(rid[1:]) % 2 == 0]
    upto = mixed["stable_tokens"]
    same = [rid for rid in free if none["tokens"][rid][:upto] == mixed["tokens"][rid][:upto]]
    # The matched run has the mixed run's batch shapes at every step: whole answers compare.
    same_whole = [rid for rid in free if matched["tokens"][rid] == mixed["tokens"][rid]]
    overhead = _ratio(mixed, matched)
    return {
        "batch": none["batch"],
        "step_ms_none": none["step_ms_median"],
        "step_ms_matched": matched["step_ms_median"],
        "step_ms_mixed": mixed["step_ms_median"],
        "step_ms_mixed_inline": inline["step_ms_median"] if inline else None,
        "mask_overhead": overhead,
        "mask_overhead_inline": _ratio(inline, matched),
        "mixed_over_plain_none": _ratio(mixed, none),
        "timed_steps": [none["timed_steps"], matched["timed_steps"], mixed["timed_steps"]],
        "goal_met": overhead is not None and overhead <= 0.10,
        "free_requests": len(free),
        "free_token_identical": len(same),
        "free_tokens_compared": upto,
        "free_identical_whole_answers_vs_matched": len(same_whole),
        "grammars_compiled": mixed["grammars_compiled"],
        "constrained_answers": mixed["constrained_answers"],
        "phases_ms_per_step": {
            "none": none["phases_ms_per_step"],
            "matched": matched["phases_ms_per_step"],
            "mixed": mixed["phases_ms_per_step"],
            **({"mixed_inline": inline["phases_ms_per_step"]} if inline else {}),
        },
    }


def profile_run(
    loaded: LoadedModel, config: EngineConfig, batch: int, max_tokens: int, path: Path
) -> None:
    """Where the host's time goes in a mixed run: the functions by own time and by total."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(run, loaded, config, batch, max_tokens, True)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    path.write_text(text.getvalue())


def fastest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return min(runs, key=lambda r: r["step_ms_median"] or float("inf"))


def device_name(loaded: LoadedModel) -> str:
    if loaded.device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(loaded.device).lower()
    return next((gpu for gpu in ("h100", "h200", "a100", "l4") if gpu in name), "cuda")


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Structured output: step time with grammar masks ({report['device']})",
        "",
        f"`{report['command']}`",
        "",
        f"Model: random {report['shape']} Llama, {report['dtype']}, {report['tokenizer']}'s "
        "tokenizer and "
        f"{report['vocab']}-token vocabulary; {report['max_tokens']} greedy tokens per request; "
        "mixed = every other request constrained (12 client schemas, any JSON object, a tool "
        "call), each finished constrained answer replaced by a new one while free rows run. "
        "Matched = the same without masks: the odd rows free, ending after as many tokens as "
        "the mixed run's constrained answers and replaced the same way, so both run the same "
        "batch shapes (the same replacement prefills) at every step; mask overhead = mixed / "
        "matched - 1. None = every request free, no replacements. Mixed, inline: the masks "
        "filled on the engine's thread instead of the sampler's filler thread (the engine "
        "before the filler). "
        "Step: schedule to sampled tokens on the host, median over the decode steps in "
        "which the whole batch runs; each run repeated, the fastest kept; all arms in one run. "
        "Goal: mask overhead <= 10% of the step.",
        "",
        "| batch | step ms: none / matched / mixed | mask overhead | goal | mixed, inline "
        "(overhead) | free answers identical: vs matched (whole) / vs none (first tokens) "
        "| constrained answers | timed steps (none, matched, mixed) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        overhead = row["mask_overhead"]
        inline = "-"
        if row.get("step_ms_mixed_inline") is not None:
            share = row["mask_overhead_inline"] * 100
            inline = f"{row['step_ms_mixed_inline']:.2f} ({share:+.1f}%)"
        steps = ", ".join(str(n) for n in row["timed_steps"])
        lines.append(
            f"| {row['batch']} | {row['step_ms_none']:.2f} / {row['step_ms_matched']:.2f} / "
            f"{row['step_ms_mixed']:.2f} | {overhead * 100:+.1f}% "
            f"| {'met' if row['goal_met'] else 'NOT met'} | {inline} "
            f"| {row['free_identical_whole_answers_vs_matched']}/{row['free_requests']} / "
            f"{row['free_token_identical']}/{row['free_requests']} "
            f"(first {row['free_tokens_compared']}) "
            f"| {row['constrained_answers']} | {steps} |"
        )
    if report.get("profile"):
        lines += [
            "",
            f"Host profile of one mixed run (batch {report['profile_batch']}): "
            f"`{report['profile']}`.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer dir")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="the preset's")
    parser.add_argument("--tokenizer-name", default=None, help="for the report (its dir's name)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, fastest kept")
    parser.add_argument(
        "--profile", action="store_true",
        help="also profile one mixed run of the largest batch on the host (cProfile, .prof.txt)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    preset = PRESETS[args.preset or ("gpu" if device == "cuda" else "cpu")]
    shape_name = args.shape or preset.shape
    shape = dict(SHAPES[shape_name])
    with tempfile.TemporaryDirectory() as tmp:
        from fedllm_contract.tokenizer import load_tokenizer

        shape["vocab_size"] = len(load_tokenizer(args.tokenizer))
        dtype = getattr(torch, preset.dtype)
        model_dir, _ = build_model_dir(Path(tmp) / "model", shape, args.tokenizer, dtype, 0, device)
        loaded = load_model(model_dir, device=device, dtype=preset.dtype)
    rows = []
    for batch in preset.batches:
        config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * 32))
        run(loaded, config, batch, preset.max_tokens, mixed=False)  # warm-up, not counted
        # Alternated, each kept at its fastest of `repeats`: a shared machine's noise slows
        # runs, it never speeds one up.
        nones, mixeds, matcheds, inlines = [], [], [], []
        for _ in range(args.repeats):
            nones.append(run(loaded, config, batch, preset.max_tokens, mixed=False))
            mixeds.append(run(loaded, config, batch, preset.max_tokens, mixed=True))
            lengths = mixeds[-1]["answer_lengths"]
            matcheds.append(run(loaded, config, batch, preset.max_tokens, False, matched=lengths))
            if loaded.device.type == "cuda":  # elsewhere steps are synchronous: always inline
                inlines.append(run(loaded, config, batch, preset.max_tokens, True, inline=True))
        rows.append(
            compare(
                fastest(nones),
                fastest(mixeds),
                fastest(matcheds),
                fastest(inlines) if inlines else None,
            )
        )
        rows[-1]["same_tokens_every_run"] = all(
            r["tokens"] == nones[0]["tokens"] for r in nones
        ) and all(r["tokens"] == mixeds[0]["tokens"] for r in mixeds + inlines)
        rows[-1]["same_tokens_every_run"] &= all(
            r["tokens"] == matcheds[0]["tokens"] for r in matcheds
        )
        print(json.dumps(rows[-1]), flush=True)
    name = device_name(loaded)
    tokenizer = args.tokenizer_name or args.tokenizer.resolve().name
    suffix = "" if shape_name == preset.shape else f"_{shape_name}"
    out = args.out or RESULTS / f"structured_output_{name}{suffix}"
    out.parent.mkdir(parents=True, exist_ok=True)
    profile = None
    if args.profile:
        profile = out.with_suffix(".prof.txt")
        batch = preset.batches[-1]
        config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * 32))
        profile_run(loaded, config, batch, preset.max_tokens, profile)
    report = {
        "command": f"python -m bench.engine.structured_output --tokenizer <{tokenizer} tokenizer>"
        + (f" --preset {args.preset}" if args.preset else "")
        + (f" --shape {args.shape}" if args.shape else "")
        + f" --repeats {args.repeats}",
        "device": name,
        "shape": shape_name,
        "tokenizer": tokenizer,
        "dtype": preset.dtype,
        "vocab": shape["vocab_size"],
        "max_tokens": preset.max_tokens,
        "machine": machine(),
        "rows": rows,
        "profile": profile.name if profile else None,
        "profile_batch": preset.batches[-1],
    }
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
