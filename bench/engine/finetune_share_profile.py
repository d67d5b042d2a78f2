"""One profiling call that decides how a LoRA fine-tuning job trains beside serving (issue 70):
spatial sharing (the training step as a CUDA graph on a low-priority stream), training rows
inside the serving step (FineInfer-style heterogeneous batching, their backward in pieces), or
a mix. Three measurements on the Llama-3-8B shape (bf16, random weights built on the card, as
bench.engine.finetune_profile builds them), one GPU:

1. the idle SM time of serving steps at `load` (0.6) x the engine's capacity: per step, the
   share with no kernel running, the share in memory-bound kernels and the model FLOPs over
   the card's peak, from the torch profiler's kernel timeline (finetune_share_serving.py);
2. what a training step replayed on a low-priority stream does to decode steps of 256 rows on
   a high-priority one, and the training throughput it gets there (finetune_share_priority.py);
3. the forward cost of N training tokens riding in a decode step, and their backward's cost
   run on its own (finetune_share_rows.py).
The .md opens with the decision the numbers favour against the issue's targets
(finetune_share_report.py).

    python -m bench.engine.finetune_share_profile              (GPU: about 3 minutes)
    python -m bench.engine.finetune_share_profile --cpu-smoke  (a tiny model: the wiring)

Device command (one H100 or H200; carry `.finetunecarry`, made here first by
`bash bench/engine/finetune_carry.sh`):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .finetunecarry/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \
    python3 -m bench.engine.finetune_share_profile \
        --tokenizer-dir .finetunecarry/tokenizers/gpt2 --results-dir "$OUT"
It writes finetune_share_profile_<card>.{json,md} (h100, h200; cpu for the smoke).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import command_line, results_dir, write_results
from bench.engine.engine_runs import warm_up
from bench.engine.finetune_colocated import PRESETS as COLOCATED
from bench.engine.finetune_profile import build_model, examples
from bench.engine.finetune_share_priority import profile_priority
from bench.engine.finetune_share_report import decide, report
from bench.engine.finetune_share_rows import profile_rows
from bench.engine.finetune_share_serving import profile_serving
from bench.engine.finetune_share_training import TrainingStep, capture
from bench.engine.harness import Progress
from bench.engine.paths import shared_path
from bench.engine.priority import build_engine, device_label
from bench.engine.priority_driver import Shape
from fedllm_contract.fine_tuning import FineTuneHyperparameters
from fedllm_contract.tokenizer import load_tokenizer
from site_engine.engine.model_config import max_model_len
from site_engine.finetune.trainer import LoraTrainer
from site_engine.model_loading import LoadedModel

# The engine and the chat of bench.engine.finetune_colocated's presets (so that "0.6x load"
# is the same load), and what this profile adds.
_ENGINE = ("shape", "device", "dtype", "max_num_seqs", "max_num_batched_tokens",
           "deferral_bound_tokens", "clock", "interactive", "burst_requests")  # fmt: skip
PRESETS: dict[str, dict[str, Any]] = {
    "gpu": {
        **{key: COLOCATED["gpu"][key] for key in _ENGINE},
        # An explicit cache (room for part 2's 256 rows at ~700 positions), so that the
        # training graphs have the rest of the card.
        "kv_cache_gib": 32.0,
        # 1. serving
        "warm_s": 8.0,
        "profile_s": 3.0,
        # 2. the training graph beside decode steps (2 x 512 tokens and an AdamW step a replay)
        "train_rows": 2,
        "train_alone_s": 3.0,
        "decode_rows": 256,
        "decode_prompt": 64,
        "block_steps": 100,
        "repeats": 2,
        "settle_steps": 20,
        # 3. training rows in a decode step
        "decode_context": 512,
        "train_tokens": (0, 64, 256, 1024, 2048),
        "train_width": 512,
        "reps": 10,
    },
    "cpu": {
        **{key: COLOCATED["cpu"][key] for key in (*_ENGINE, "kv_cache_blocks")},
        "burst_requests": 12,
        "warm_s": 1.0,
        "profile_s": 1.0,
        "train_rows": 2,
        "train_alone_s": 0.3,
        "decode_rows": 8,
        "decode_prompt": 16,
        "block_steps": 4,
        "repeats": 2,
        "settle_steps": 4,
        "decode_context": 64,
        "train_tokens": (0, 8, 32, 64),
        "train_width": 32,
        "reps": 2,
    },
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.engine.finetune_share_profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--cpu-smoke", action="store_true", help="a tiny model on the CPU (the wiring only)")
    add("--tokenizer-dir", type=Path, default=None, help="default: ../shared/tokenizers/gpt2")
    add("--results-dir", type=Path, default=results_dir("finetune_colocated"))
    add("--name", default=None, help="default: finetune_share_profile_<card>")
    add("--load", type=float, default=0.6, help="chat rate / the engine's chat capacity")
    add("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 0 < args.load < 1:
        parser.error("--load must be in (0, 1)")
    if not args.cpu_smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --cpu-smoke")
    args.p = dict(PRESETS["cpu" if args.cpu_smoke else "gpu"])
    width = args.p["train_width"]
    if any(n > width and n % width for n in args.p["train_tokens"]):
        parser.error("training tokens above the width must be whole sequences of it")
    return args


def load(args: argparse.Namespace) -> LoadedModel:
    """The served model, built in memory on the device (nothing written to disk)."""
    cuda = not args.cpu_smoke
    device = torch.device("cuda" if cuda else "cpu")
    model = build_model(args.p["shape"], device, seed=args.seed)
    tokenizer = load_tokenizer(shared_path(args.tokenizer_dir, "tokenizers", "gpt2"))
    if not cuda:
        torch.set_num_threads(1)  # as the benches time a CPU engine: no intra-op threads
    eos = tokenizer.eos_token_id
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        max_model_len=max_model_len(model.config),
        eos_token_ids=frozenset({int(eos)} if eos is not None else ()),
        device=device,
        dtype=torch.bfloat16 if cuda else torch.float32,
    )


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class Run:
    """The results file, written again after every part, each part run on its own: a part that
    fails is recorded with its error and the next one runs; a run cut short keeps the parts it
    measured (one device call is all issue 70's profile has)."""

    def __init__(self, args: argparse.Namespace, device: str, log: Progress) -> None:
        self.args, self.log = args, log
        self.name = args.name or f"finetune_share_profile_{device}"
        settings = {k: dataclasses.asdict(v) if isinstance(v, Shape) else v
                    for k, v in args.p.items() if k != "shape"}  # fmt: skip
        self.result: dict[str, Any] = {"device": device, "load": args.load,
                                       "seed": args.seed, "shape": args.p["shape"],
                                       "settings": settings}  # fmt: skip

    def part(self, name: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        try:
            value = measure()
        except Exception as exc:
            traceback.print_exc()
            value = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        self.result[name] = value
        self.write()
        self.log(f"{name}: {'failed' if 'error' in value else 'done'}")
        return None if "error" in value else value

    def write(self) -> None:
        self.result["seconds"] = self.log.elapsed()
        self.result["decision"] = decide(self.result)
        command = command_line("bench.engine.finetune_share_profile", self.args.argv)
        write_results(self.name, self.result, report(self.result), command,
                      self.args.results_dir)  # fmt: skip


def measure(loaded: LoadedModel, args: argparse.Namespace, run: Run) -> None:
    p, device, vocab = args.p, loaded.device, loaded.vocab_size
    engine = build_engine(loaded, p)
    warm_up(engine, vocab, 4, args.seed)
    run.log("engine built and warmed up")
    serving = run.part(
        "serving", lambda: profile_serving(engine, loaded.model, device, p, args.load, args.seed)
    )
    data = examples(p["train_rows"], p["train_width"], vocab, seed=args.seed)
    hp = FineTuneHyperparameters(n_epochs=1, batch_size=p["train_rows"], learning_rate_multiplier=1)
    run.result["lora"] = {"rank": hp.lora_rank, "alpha": hp.lora_alpha,
                          "target_modules": list(hp.target_modules)}  # fmt: skip
    trainer = LoraTrainer(loaded.model, hp, args.seed, data)

    def beside() -> dict[str, Any]:
        runnable = capture(TrainingStep(trainer, data, backward=True, optimizer=True))
        run.log(f"training step of {runnable.tokens} tokens: {runnable.mode}")
        return profile_priority(engine, runnable, vocab, device, p)

    run.part("priority", beside)
    engine.close()  # its cache and graphs: part 3 has a cache of its own
    _free(device)
    sizes = {p["decode_rows"]}
    rows_at_load = serving.get("host_decode_rows_median") if serving else None
    if device.type == "cuda" and rows_at_load:
        sizes.add(max(8, 8 * round(rows_at_load / 8)))  # a step's rows at the load
    settings = p | {"decode_sizes": sorted(sizes)}
    run.part("rows", lambda: profile_rows(loaded.model, trainer, device, loaded.dtype, settings))
    trainer.close()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    args.argv = argv
    log = Progress()
    loaded = load(args)
    log(f"model built on {loaded.device}")
    run = Run(args, device_label(loaded), log)
    measure(loaded, args, run)
    run.write()
    log(f"wrote {args.results_dir / run.name}.json and .md")


if __name__ == "__main__":
    main()
