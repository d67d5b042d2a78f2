"""The fine-tuning job of bench.engine.finetune_colocated and what it is compared with: the
synthetic chat data, the site's jobs over the served model, the trainer alone at the peft loop's
step, the plain peft loop itself, and the training memory against its estimate."""

from __future__ import annotations

import gc
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from bench.engine.finetune_profile import examples, peft_steps
from bench.engine.harness import GIB
from fedllm_contract.fine_tuning import FineTuneHyperparameters, FineTuneSpec
from site_engine.finetune.jobs import FineTuneJobs, FineTuneSettings
from site_engine.finetune.memory import TrainingShape, training_bytes
from site_engine.finetune.step_work import PIECE_SHARE
from site_engine.model_loading import LoadedModel

WORDS = (
    "the", "model", "answers", "in", "a", "short", "format", "with", "numbers", "and",
    "lists", "of", "steps", "when", "asked", "about", "data", "tables", "or", "code",
)  # fmt: skip


def training_jsonl(count: int, words: tuple[int, int], seed: int) -> bytes:
    """`count` chat examples (system, user, assistant) of random words, the answer being about
    three quarters of each example's `words` (chat-like: the loss falls on the answer)."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))

    lines = []
    for _ in range(count):
        n = rng.randint(*words)
        messages = [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": text(n // 4)},
            {"role": "assistant", "content": text(n - n // 4)},
        ]
        lines.append(json.dumps({"messages": messages}).encode())
    return b"\n".join(lines) + b"\n"


def freeze_startup() -> None:
    """What the bench built before measuring (the model, the engine, its graphs) out of the
    collector's sight, as a site does once it is up (site_engine/__main__.py): without it a full
    collection walked all of it, and one took 356 ms inside a training piece (issue 76's r88
    timeline, the chat phase), a pause a site does not have."""
    gc.collect()
    gc.freeze()


def start_job(
    loaded: LoadedModel, p: dict[str, Any], directory: Path, seed: int, mode: str = "idle"
) -> FineTuneJobs:
    """The site's trainer over the served model, with one job queued that outlasts the bench;
    in rows mode its pieces are bounded by `piece_share` (PIECE_SHARE unless set) of
    max_training_delay_ms. `wait_for_pieces` in `p`: each piece waited for (FineTuneJobs')."""
    share = p.get("piece_share", PIECE_SHARE)
    bound = p["max_training_delay_ms"] * share if mode == "rows" else p["max_step_ms"]
    jobs = FineTuneJobs(
        FineTuneSettings(
            directory,
            int(p["reserve_gib"] * GIB),
            checkpoint_every=1_000_000,  # no checkpoint writes inside the measured phases
            max_step_ms=bound,
            max_tokens=p["max_tokens"],
        ),
        loaded.model,
        loaded.tokenizer,
        "bench",
        wait_for_pieces=bool(p.get("wait_for_pieces", False)),
    )
    spec = FineTuneSpec(
        job_id="bench-job",
        base_model="bench",
        training_jsonl=training_jsonl(p["examples"], p["example_words"], seed),
        validation_jsonl=None,
        hyperparameters=FineTuneHyperparameters(1000, p["batch_size"], 1.0),
        seed=seed,
    )
    jobs.start(spec)
    jobs.settled(spec.job_id)  # its file read on the site's intake thread
    return jobs


def job_at_peft_step(
    loaded: LoadedModel, p: dict[str, Any], directory: Path, seed: int, steps: int = 5
) -> dict[str, Any]:
    """The site's trainer alone, nothing waiting (idle-sized units in bounded pieces), on a job
    of the peft loop's shape (`peft_step` rows x width, every example cut to exactly the width):
    its trained tokens/s over `steps` optimizer steps after two warm-up steps."""
    rows, width = p["peft_step"]
    jobs = FineTuneJobs(
        FineTuneSettings(
            directory,
            int(p["reserve_gib"] * GIB),
            checkpoint_every=1_000_000,
            max_step_ms=p["max_step_ms"],
            max_tokens=width,
            idle_unit_tokens=rows * width,
        ),
        loaded.model,
        loaded.tokenizer,
        "bench",
    )
    # As many words as the width: with the chat template's tokens, longer than the width in
    # tokens whatever the tokenizer, so every example is cut to exactly the width; the question
    # (a quarter of the words) ends well within it, so the loss has the answer's start.
    data = training_jsonl(rows * (steps + 2), (width, width), seed)
    hp = FineTuneHyperparameters(2, rows, 1.0)  # an epoch more: no adapter saved while timed
    jobs.start(FineTuneSpec("peft-shaped", "bench", data, None, hp, seed))
    jobs.settled("peft-shaped")
    cuda = loaded.device.type == "cuda"
    jobs.run_unit(alone=True)  # builds the trainer

    def run_to(step: int) -> None:
        while jobs.progress("peft-shaped").step < step:
            jobs.run_unit(alone=True)

    run_to(2)
    if cuda:
        torch.cuda.synchronize()
    before, pieces = jobs.progress("peft-shaped").trained_tokens, jobs.pieces_run
    began = time.perf_counter()
    run_to(2 + steps)  # the last piece of a unit synchronises (pieces.py): the device's time
    seconds = time.perf_counter() - began
    tokens = jobs.progress("peft-shaped").trained_tokens - before
    jobs.cancel("peft-shaped")
    jobs.run_unit()  # drops its trainer
    if cuda:
        torch.cuda.empty_cache()
    return {"rows": rows, "width": width, "steps": steps, "seconds": seconds,
            "trained_tokens": tokens, "tokens_per_s": tokens / seconds,
            "largest_unit_tokens": jobs.largest_unit_run,
            "pieces_per_step": (jobs.pieces_run - pieces) / steps}  # fmt: skip


def training_memory(
    jobs: FineTuneJobs, loaded: LoadedModel, peak_bytes: int | None
) -> dict[str, Any]:
    """The estimate (site_engine/finetune/memory.py) for the largest unit the job ran, against
    the peak CUDA allocated above what was allocated before the job (None on a CPU)."""
    cap, longest = jobs.unit_cap("bench-job")
    hp = FineTuneHyperparameters(1000, 1, 1.0)  # the bench job's LoRA (its batch is not used)
    largest = jobs.largest_unit_run
    estimate = training_bytes(TrainingShape.of_model(loaded.model), hp, largest, longest)
    return {
        "largest_unit_tokens": largest,
        "unit_cap_tokens": cap,
        "estimate_bytes": estimate,
        "cuda_peak_bytes": peak_bytes,
        "estimate_covers_peak": None if peak_bytes is None else estimate >= peak_bytes,
        "peak_over_estimate": None if peak_bytes is None else peak_bytes / estimate,
    }


def peft_alone(model: Any, rows: int, width: int, steps: int = 5) -> dict[str, Any]:
    """A plain peft + transformers loop on the same model (bf16 on a GPU, SDPA, fused AdamW)
    at `rows` x `width` tokens a step: its trained tokens/s over `steps` after two warm-ups."""
    data = examples(rows * (steps + 2), width, int(model.config.vocab_size), seed=rows * width)
    step, close = peft_steps(model, data, rows)
    cuda = next(model.parameters()).device.type == "cuda"
    for _ in range(2):
        step()
    if cuda:
        torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    close()
    if cuda:
        torch.cuda.empty_cache()
    return {"rows": rows, "width": width, "steps": steps, "seconds": seconds,
            "tokens_per_s": rows * width * steps / seconds}  # fmt: skip
