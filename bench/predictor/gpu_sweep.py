"""Larger fine-tuning runs of the length predictor on a GPU, scored like bench.predictor.

    python -m bench.predictor.gpu_sweep --out DIR [--scheme mico_n10_l1024] [--variants a,b]

The default artifact trains on two CPU cores in minutes (3 layers, 20k prompts, one epoch, the
embedding table frozen). This sweep asks what more training buys: every MiniLM layer, all the
training prompts, several epochs, on a CUDA device. Each variant is scored with the torch model
on the same test splits as bench.predictor (accuracy, within one bucket, MAE of the expected
length, Spearman), next to the majority bucket and the training mean. The variant with the best
validation accuracy on the Alpaca random rows is saved (float16 state dict) for export.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from predictor.buckets import scheme_by_name
from predictor.distribution import bucket_lengths
from predictor.encoding import PromptEncoder, pretrained_dir
from predictor.evaluate import majority_bucket, score_mean, score_probabilities
from predictor.finetune import FinetuneConfig, finetune, predict_torch, subsample
from predictor.prepare import EVAL_DATASETS, prepare

BASE = FinetuneConfig(
    max_train=0,
    epochs=2,
    batch_size=64,
    learning_rate=5e-5,
    head_learning_rate=1e-3,
    layers=6,
    freeze_embeddings=False,
    device="cuda",
)
VARIANTS: dict[str, FinetuneConfig] = {
    "l6_e2": BASE,
    "l6_e4_lr3e-5": replace(BASE, epochs=4, learning_rate=3e-5),
    "l6_e2_len256": replace(BASE, max_tokens=256),
    "l3_e3": replace(BASE, layers=3, epochs=3),
}


def log(message: str) -> None:
    print(message, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.predictor.gpu_sweep")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--tokenizer-dir", type=Path)
    parser.add_argument("--cache-dir", type=Path)
    parser.add_argument("--scheme", default="mico_n10_l1024")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = prepare(args.data_dir, args.tokenizer_dir, args.cache_dir, log)
    train_lengths = [r.length for r in data.train]
    scheme = scheme_by_name(args.scheme, train_lengths)
    table = bucket_lengths(scheme, train_lengths)
    majority = majority_bucket(scheme, train_lengths)
    results: dict[str, Any] = {
        "scheme": args.scheme,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "train_prompts": len(data.train),
        "mean": {
            name: score_mean(scheme, train_lengths, data.test[name], majority).to_json()
            for name in EVAL_DATASETS
        },
        "variants": {},
    }
    best: tuple[float, str] = (-1.0, "")
    for name in args.variants.split(","):
        config = VARIANTS[name]
        encoder = PromptEncoder.from_dir(pretrained_dir(), max_tokens=config.max_tokens)
        chosen = [data.train[i] for i in subsample(len(data.train), config.max_train, config.seed)]
        labels = scheme.buckets_of([r.length for r in chosen])
        log(f"== {name}: {len(chosen)} prompts, {asdict(config)}")
        started = time.monotonic()
        model, stats = finetune([r.prompt for r in chosen], labels, scheme.n_buckets, encoder,
                                config, log)  # fmt: skip
        model = model.to(config.device)
        row: dict[str, Any] = {
            "config": asdict(config),
            "train_s": time.monotonic() - started,
            "steps": stats.steps,
            "final_loss": stats.final_loss,
        }
        validation = [r for r in data.validation if r.corpus == "alpaca_random"] or list(
            data.validation
        )
        val_probs = predict_torch(model, encoder, [r.prompt for r in validation], 256)
        row["validation_alpaca"] = score_probabilities(
            val_probs, table, scheme, validation, majority
        ).to_json()
        for test_name in EVAL_DATASETS:
            records = data.test[test_name]
            probs = predict_torch(model, encoder, [r.prompt for r in records], 256)
            row[test_name] = score_probabilities(probs, table, scheme, records, majority).to_json()
        log(json.dumps({k: v for k, v in row.items() if k != "config"}, indent=1))
        results["variants"][name] = row
        accuracy = float(row["validation_alpaca"]["accuracy"])
        if accuracy > best[0]:
            best = (accuracy, name)
            state = {k: v.half().cpu() for k, v in model.state_dict().items()}
            torch.save({"variant": name, "config": asdict(config), "state": state},
                       args.out / "best.pt")  # fmt: skip
        del model
        torch.cuda.empty_cache()
    results["best_by_validation"] = best[1]
    (args.out / "gpu_sweep.json").write_text(json.dumps(results, indent=2) + "\n")
    log(f"best by validation accuracy: {best[1]} ({best[0]:.4f})")


if __name__ == "__main__":
    main()
