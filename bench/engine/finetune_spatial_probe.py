"""Issue 76's physics probe: can training share the card with serving in space, not in time?

Rows mode takes turns: a training piece after each serving step. At chat load 0.3 on an H200
(8B), a decode step takes ~5.6 ms, so a TPOT p99 within 1.2x leaves training ~1.1 ms a step:
at most ~0.16 of the card's time, against a goal of 0.6 of the job's speed alone. Turns cannot
meet that goal at any piece size. Decode, though, is bound by the weights' bytes (its GEMMs
read 16 GB a step and compute little), training by arithmetic (its GEMMs do ~28 GFLOP a token).
Run side by side, each could use what the other leaves. This probe measures how much, before
anything is built on it:

- **serving**: the real engine (PagedEngine, CUDA graphs) decoding `b` sequences, the period of
  consecutive steps (synchronized only around the run, as bench.engine.decode_sweep does);
- **training**: the GEMMs of LoRA training on the same shape, without the LoRA matrices (which
  are ~1% of its arithmetic): per layer the forward (x @ W for q/k/v, o, gate/up, down) and the
  input gradient (g @ W.T), on `--train-tokens` tokens, over weights of four layers cycled
  through (so they stream from memory as a model's do). A thread launches them on a stream of
  its own and keeps at most two units in flight;
- each alone, then together: serving on a high-priority stream and training on a low-priority
  one, then both at the same priority.

It reports, per batch size, the decode period with training beside it over the period alone
(the TPOT cost) and the training GEMMs' rate beside serving over their rate alone (the job's
share). Nothing here trains a model or changes the product.

    python -m bench.engine.finetune_spatial_probe --preset gpu   (one card, ~3 minutes)
    python -m bench.engine.finetune_spatial_probe --preset cpu   (the wiring, on the CPU)
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import command_line, markdown_table, results_dir, write_results
from bench.engine.decode_sweep import _decode_step, _start_decoding
from bench.engine.finetune_profile import examples
from bench.engine.harness import Progress, free_device_memory, sync
from bench.engine.model_setup import LLAMA_8B_8K_SHAPE, SMALL_SHAPE, preset_model
from fedllm_contract.fine_tuning import FineTuneHyperparameters
from site_engine.engine.kv_cache import KVCacheSpec, kv_cache_bytes_per_block
from site_engine.engine.paged_engine import EngineConfig, PagedEngine
from site_engine.finetune.trainer import LoraTrainer
from site_engine.model_loading import LoadedModel

PRESETS: dict[str, dict[str, Any]] = {
    "gpu": {"shape": LLAMA_8B_8K_SHAPE, "dtype": "bfloat16", "device": "cuda",
            "batches": (32, 128), "train_tokens": 2048, "steps": 150, "trainer": (8, 256)},
    "cpu": {"shape": SMALL_SHAPE, "dtype": "float32", "device": "cpu",
            "batches": (4,), "train_tokens": 64, "steps": 20, "trainer": (2, 32)},
}  # fmt: skip
_CYCLED_LAYERS = 4
_IN_FLIGHT = 2
_ALONE_S = 3.0
_WARM_S = 1.0


@dataclass(slots=True)
class TrainingGemms:
    """The GEMMs of one training unit on a model's shape (forward and input gradient)."""

    weights: list[list[torch.Tensor]]  # per cycled layer: qkv, o, gate_up, down ([in, out])
    layers: int
    tokens: int

    @classmethod
    def of(cls, loaded: LoadedModel, tokens: int) -> TrainingGemms:
        config = loaded.model.config
        hidden, inter = config.hidden_size, config.intermediate_size
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = hidden // heads
        shapes = ((hidden, (heads + 2 * kv_heads) * head_dim), (hidden, hidden),
                  (hidden, 2 * inter), (inter, hidden))  # fmt: skip
        gen = torch.Generator(device=loaded.device).manual_seed(0)
        weights = [
            [torch.randn(s, generator=gen, device=loaded.device, dtype=loaded.dtype) * 0.02
             for s in shapes]
            for _ in range(_CYCLED_LAYERS)
        ]  # fmt: skip
        return cls(weights, config.num_hidden_layers, tokens)

    def flops(self) -> float:
        per_layer = sum(w.shape[0] * w.shape[1] for w in self.weights[0])
        return 2 * 2 * self.tokens * per_layer * self.layers  # forward + input gradient

    def unit(self) -> float:
        hidden = self.weights[0][0].shape[0]
        device, dtype = self.weights[0][0].device, self.weights[0][0].dtype
        x = torch.ones(self.tokens, hidden, device=device, dtype=dtype)
        for layer in range(self.layers):
            qkv, o, gate_up, down = self.weights[layer % _CYCLED_LAYERS]
            # The forward's shapes, then the input gradient's (the same weights transposed).
            q = x @ qkv
            y = q[:, :hidden] @ o
            h = y @ gate_up
            z = h[:, : down.shape[0]] @ down
            g = z @ down.T
            g = torch.cat([g, g], dim=1) @ gate_up.T
            g = g @ o.T
            torch.cat([g, q[:, hidden:]], dim=1) @ qkv.T
        return self.flops()


class TrainingThread:
    """Training units launched back to back on `stream` from a thread of their own; `unit`
    launches one and returns its work (FLOPs, tokens)."""

    def __init__(self, unit: Callable[[], float], stream: torch.cuda.Stream | None) -> None:
        self.unit, self.stream = unit, stream
        self.work = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="training", daemon=True)

    def _run(self) -> None:
        pending: list[tuple[Any, float]] = []
        while not self._stop.is_set():
            if self.stream is None:  # the CPU: no streams, the thread's own time
                self.work += self.unit()
                continue
            with torch.cuda.stream(self.stream):
                work = self.unit()
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self.stream)
            pending.append((event, work))
            if len(pending) > _IN_FLIGHT:
                done, work = pending.pop(0)
                done.synchronize()
                self.work += work
        for event, _ in pending:
            event.synchronize()

    def __enter__(self) -> TrainingThread:
        self._thread.start()
        time.sleep(0.3)  # its first units in flight before anything is timed
        self.work = 0.0
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def _stream(device: torch.device, priority: int) -> torch.cuda.Stream | None:
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device, priority=priority)  # type: ignore[no-untyped-call]


def _green_stream(device: torch.device, sms: int) -> torch.cuda.Stream | None:
    """A stream whose kernels run on `sms` SMs only (a CUDA green context), or None where this
    torch or driver has none (the CPU, say)."""
    if device.type != "cuda":
        return None
    try:
        from torch.cuda.green_contexts import GreenContext

        context: Any = GreenContext.create(num_sms=sms, device_id=device.index or 0)
        _GREEN_CONTEXTS.append(context)  # a stream lives only as long as its context
        return context.Stream()  # type: ignore[no-any-return]  # beta: untyped
    except Exception as exc:  # beta API: its absence is a finding, not a failure
        print(f"no green context of {sms} SMs: {exc!r}", flush=True)
        return None


_GREEN_CONTEXTS: list[Any] = []


def _decode_period_ms(
    engine: PagedEngine, generated: dict[str, int], steps: int, stream: torch.cuda.Stream | None
) -> float:
    device = torch.device("cuda") if torch.cuda.is_available() else None
    if device is not None:
        sync(device)
    began = time.perf_counter()
    if stream is None:
        for _ in range(steps):
            _decode_step(engine, generated)
    else:
        with torch.cuda.stream(stream):
            for _ in range(steps):
                _decode_step(engine, generated)
    if device is not None:
        sync(device)
    return 1000 * (time.perf_counter() - began) / steps


def _training_rate(
    unit: Callable[[], float], stream: torch.cuda.Stream | None, seconds: float
) -> float:
    """Training work a second, alone."""
    with TrainingThread(unit, stream) as thread:
        began = time.perf_counter()
        time.sleep(seconds)
        work = thread.work
        took = time.perf_counter() - began
    return work / took


def _together(
    engine: PagedEngine,
    generated: dict[str, int],
    steps: int,
    unit: Callable[[], float],
    serving: torch.cuda.Stream | None,
    training: torch.cuda.Stream | None,
) -> tuple[float, float]:
    """(decode period ms, training work a second) with both running."""
    with TrainingThread(unit, training) as thread:
        began = time.perf_counter()
        period = _decode_period_ms(engine, generated, steps, serving)
        work, took = thread.work, time.perf_counter() - began
    return period, work / took


def site_trainer(loaded: LoadedModel, rows: int, width: int) -> Callable[[], float]:
    """The site's own LoRA trainer on the serving model's weights (shared, as a site's job
    does): one unit a call of `rows` examples of `width` random tokens; returns its tokens."""
    vocab = int(loaded.model.config.vocab_size)
    data = examples(rows * 1000, width, vocab, seed=1)
    trainer = LoraTrainer(loaded.model, FineTuneHyperparameters(1, rows, 1.0), 0, data)
    return lambda: float(trainer.work(rows * width))


def _engine(loaded: LoadedModel, batch: int, max_tokens: int) -> PagedEngine:
    block = 16
    per_block = kv_cache_bytes_per_block(
        KVCacheSpec.from_config(loaded.model.config), block, loaded.dtype
    )
    # Room for every sequence's whole length and the 1% the scheduler keeps out of its plans.
    blocks = int(batch * (-(-(64 + max_tokens) // block)) * 1.05) + 16
    config = EngineConfig(
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, 64 * batch),
        block_size=block,
        kv_cache_bytes=blocks * per_block,
    )
    return PagedEngine(loaded, config)


Arm = tuple[str, "torch.cuda.Stream | None", "torch.cuda.Stream | None"]


def _arms(
    engine: PagedEngine,
    generated: dict[str, int],
    steps: int,
    unit: Callable[[], float],
    full: torch.cuda.Stream | None,
    arms: list[Arm],
) -> dict[str, float]:
    """One training kind: its rate alone on the whole card (`full`), then beside serving in
    each arm (label, serving's stream, training's stream)."""
    _training_rate(unit, full, _WARM_S)  # first calls: kernels chosen, memory taken
    alone = _training_rate(unit, full, _ALONE_S)
    if alone <= 0:
        raise RuntimeError("the training thread did no work alone (its error is above)")
    out = {"alone_per_s": alone}
    for label, serving, training in arms:
        period, rate = _together(engine, generated, steps, unit, serving, training)
        out[f"decode_ms_{label}"] = period
        out[f"train_vs_alone_{label}"] = rate / alone
    return out


def _arm_list(device: torch.device, green_sms: Sequence[int]) -> list[Arm]:
    """Training at a low priority beside serving at a high one; both at one priority; training
    held to a few SMs (green contexts) beside serving on the whole card."""
    arms: list[Arm] = [("priority", _stream(device, -1), _stream(device, 0)),
                       ("same", None, _stream(device, 0))]  # fmt: skip
    for sms in green_sms:
        green = _green_stream(device, sms)
        if green is not None:
            arms.append((f"green{sms}", None, green))
    return arms


def probe_batch(
    loaded: LoadedModel,
    batch: int,
    steps: int,
    training: dict[str, Callable[[], float]],
    green_sms: Sequence[int],
    log: Progress,
) -> dict[str, Any]:
    """Every arm at one batch size."""
    device = loaded.device
    # Every arm's steps (a warm-up, serving alone twice, then each arm of both training kinds)
    # and a margin: the contexts, and the KV cache (2 MiB a block on the 8B shape), stay small.
    max_tokens = 12 * steps + 64
    engine = _engine(loaded, batch, max_tokens)
    args = argparse.Namespace(decode_prompt_len=64, seed=0)
    vocab = len(loaded.tokenizer)  # the engine takes the tokenizer's ids only
    try:
        generated = _start_decoding(engine, args, batch, max_tokens, 2, vocab)
        arms = _arm_list(device, green_sms)
        _decode_period_ms(engine, generated, steps // 4, arms[0][1])  # warm
        alone = _decode_period_ms(engine, generated, steps, None)
        alone_high = _decode_period_ms(engine, generated, steps, arms[0][1])
        row: dict[str, Any] = {"batch": batch, "decode_ms_alone": alone,
                               "decode_ms_alone_high_priority": alone_high,
                               "arms": [label for label, _, _ in arms]}  # fmt: skip
        for kind, unit in training.items():
            figures = _arms(engine, generated, steps, unit, _stream(device, 0), arms)
            for label, serving, _ in arms:
                base = alone if serving is None else alone_high
                figures[f"decode_vs_alone_{label}"] = figures[f"decode_ms_{label}"] / base
            row[kind] = figures
            said = [f"{label}: decode x{figures[f'decode_vs_alone_{label}']:.2f}, "
                    f"training {figures[f'train_vs_alone_{label}']:.2f} of alone"
                    for label, _, _ in arms]  # fmt: skip
            log(f"batch {batch}, {kind}: decode {alone:.2f} ms alone; " + "; ".join(said))
    finally:
        del engine
        free_device_memory(device)
    return row


def report(result: dict[str, Any]) -> str:
    header = ("decode rows", "training", "arm", "decode ms alone", "decode ms beside",
              "decode vs alone", "training vs alone")  # fmt: skip
    rows = [
        (r["batch"], kind, label, r["decode_ms_alone"], r[kind][f"decode_ms_{label}"],
         r[kind][f"decode_vs_alone_{label}"], r[kind][f"train_vs_alone_{label}"])
        for r in result["rows"] for kind in result["training"] for label in r["arms"]
    ]  # fmt: skip
    return "\n".join([
        f"Training kinds: {result['training']}.", "",
        "Arms: `priority`, training on a low-priority stream beside serving on a high-priority "
        "one; `same`, both at one priority; `greenN`, training on a green context of N SMs "
        "beside serving on the whole card. Training vs alone: its rate over its rate alone on "
        "the whole card.", "",
        markdown_table(header, rows), "",
    ])  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--batches", default=None, help="decode rows, comma-separated")
    parser.add_argument("--train-tokens", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--green-sms", default="33,66",
                        help="SMs of each green-context arm, comma-separated")  # fmt: skip
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--tokenizer-dir", type=Path, default=None)
    parser.add_argument("--results-dir", type=Path, default=results_dir("finetune_colocated"))
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)
    p = PRESETS[args.preset]
    batches = [int(b) for b in args.batches.split(",")] if args.batches else list(p["batches"])
    log = Progress()
    loaded = preset_model(p, args.model_dir, args.tokenizer_dir, log, f"spatial-{args.preset}")
    gemms = TrainingGemms.of(loaded, args.train_tokens or p["train_tokens"])
    rows, width = p["trainer"]
    training = {"gemms": gemms.unit, "trainer": site_trainer(loaded, rows, width)}
    steps = args.steps or p["steps"]
    green = [int(n) for n in args.green_sms.split(",") if n]
    results = [probe_batch(loaded, b, steps, training, green, log) for b in batches]
    name = args.name or f"finetune_spatial_probe_{args.preset}"
    described = {
        "gemms": f"forward + input-gradient GEMMs of every layer on {gemms.tokens} tokens "
        f"({gemms.flops() / 1e12:.2f} TFLOP a unit; rates in FLOP/s)",
        "trainer": f"the site's LoraTrainer, units of {rows} x {width} tokens (rates in tokens/s)",
    }
    result: dict[str, Any] = {"training": described, "rows": results}
    command = command_line("bench.engine.finetune_spatial_probe", argv)
    write_results(name, result, report(result), command, args.results_dir)
    log(f"wrote {args.results_dir / name}.json")


if __name__ == "__main__":
    main()
