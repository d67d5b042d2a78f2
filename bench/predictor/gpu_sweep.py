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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from predictor.buckets import scheme_by_name
from predictor.distribution import bucket_lengths
from predictor.encoding import PromptEncoder, pretrained_dir
from predictor.evaluate import majority_bucket, score_mean, score_probabilities
from predictor.finetune import PRESETS, FinetuneConfig, finetune, predict_torch, subsample
from predictor.prepare import EVAL_DATASETS, prepare

# The sweep's reference: the gpu preset's optimizer settings, with MiniLM's six layers, two
# epochs and cross-entropy alone (what the first sweep ran).
BASE = replace(
    PRESETS["gpu"], layers=6, epochs=2, length_loss_weight=0.0, prompt_length_feature=False
)
# The first sweeps' configurations predate the prompt-length input; they keep their meaning.
CPU_DEFAULT = replace(FinetuneConfig(), device="cuda", prompt_length_feature=False)
ALPACA = ("alpaca_random", "alpaca")


@dataclass(frozen=True, slots=True)
class Variant:
    config: FinetuneConfig
    # Training corpora (None: the whole training mix); "alpaca" is the curated Alpaca rows.
    corpora: tuple[str, ...] | None = None


VARIANTS: dict[str, Variant] = {
    "l6_e2": Variant(BASE),
    "l6_e4_lr3e-5": Variant(replace(BASE, epochs=4, learning_rate=3e-5)),
    "l6_e2_len256": Variant(replace(BASE, max_tokens=256)),
    "l3_e3": Variant(replace(BASE, layers=3, epochs=3)),
    "l6_e2_s1": Variant(replace(BASE, seed=1)),
    "l6_e2_s2": Variant(replace(BASE, seed=2)),
    "l6_e2_alpaca": Variant(BASE, ALPACA),
    "l6_e3_alpaca_random": Variant(replace(BASE, epochs=3), ("alpaca_random",)),
    # The default CPU artifact's configuration, run on the GPU, with and without the length term.
    "cpu_default": Variant(CPU_DEFAULT),
    **{
        f"cpu_default_len{weight:g}": Variant(replace(CPU_DEFAULT, length_loss_weight=weight))
        for weight in (1.0, 5.0, 10.0, 20.0, 50.0)
    },
    **{
        f"l6_e2_len{weight:g}": Variant(replace(BASE, length_loss_weight=weight))
        for weight in (0.5, 1.0, 2.0, 10.0, 30.0)
    },
    **{
        f"l{layers}_e{epochs}_len10_s{seed}": Variant(
            replace(BASE, layers=layers, epochs=epochs, seed=seed, length_loss_weight=10.0)
        )
        for layers, epochs in ((3, 2), (3, 3), (6, 2))
        for seed in (0, 1, 2)
    },
    # The gpu and cpu presets, each with and without the prompt's whole length as a head input.
    **{
        f"{preset}{'_chars' if chars else ''}_s{seed}": Variant(
            replace(config, seed=seed, prompt_length_feature=chars)
        )
        for preset, config in (("gpu", PRESETS["gpu"]), ("cpu", CPU_DEFAULT))
        for chars in (False, True)
        for seed in (0, 1, 2)
    },
    # The default artifact's recipe (cpu_chars_s*) with fewer encoder layers: the prediction
    # streams its int8 weights from memory on every lone request, ~1/3 fewer bytes per layer cut.
    **{
        f"cpu_chars_l{layers}_s{seed}": Variant(
            replace(CPU_DEFAULT, layers=layers, seed=seed, prompt_length_feature=True)
        )
        for layers in (1, 2)
        for seed in (0, 1, 2)
    },
    # The same recipe with its three layers narrowed (predictor.minilm.narrow_layer): feed-forward
    # neurons kept / attention heads kept, of MiniLM's 1,536 / 12.
    **{
        f"cpu_chars_f{ffn}h{heads}_s{seed}": Variant(
            replace(CPU_DEFAULT, ffn_width=ffn, heads=heads, seed=seed, prompt_length_feature=True)
        )
        for ffn, heads in ((768, 8), (512, 6))
        for seed in (0, 1, 2)
    },
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
    ensemble: dict[str, list[Any]] = {}
    for name in args.variants.split(","):
        variant = VARIANTS[name]
        config = variant.config
        encoder = PromptEncoder.from_dir(pretrained_dir(), max_tokens=config.max_tokens)
        pool = [r for r in data.train if variant.corpora is None or r.corpus in variant.corpora]
        chosen = [pool[i] for i in subsample(len(pool), config.max_train, config.seed)]
        lengths = [r.length for r in chosen]
        labels = scheme.buckets_of(lengths)
        log(f"== {name}: {len(chosen)} prompts, {asdict(config)}, corpora {variant.corpora}")
        started = time.monotonic()
        model, stats = finetune([r.prompt for r in chosen], labels, scheme.n_buckets, encoder,
                                config, log, lengths, table.representatives)  # fmt: skip
        model = model.to(config.device)
        row: dict[str, Any] = {
            "config": asdict(config),
            "train_s": time.monotonic() - started,
            "steps": stats.steps,
            "final_loss": stats.final_loss,
        }
        # Per corpus on the validation split, so a choice between variants need not look at the
        # test split ("validation_alpaca" keeps the first sweeps' key).
        val_probs = predict_torch(model, encoder, [r.prompt for r in data.validation], 256)
        row["validation"] = {}
        for corpus in EVAL_DATASETS:
            mask = [r.corpus == corpus for r in data.validation]
            records = [r for r, m in zip(data.validation, mask, strict=True) if m]
            row["validation"][corpus] = score_probabilities(
                val_probs[mask], table, scheme, records, majority
            ).to_json()
        row["validation_alpaca"] = row["validation"]["alpaca_random"]
        for test_name in EVAL_DATASETS:
            records = data.test[test_name]
            probs = predict_torch(model, encoder, [r.prompt for r in records], 256)
            row[test_name] = score_probabilities(probs, table, scheme, records, majority).to_json()
            if name.startswith("l6_e2") and variant.corpora is None and "len" not in name:
                ensemble.setdefault(test_name, []).append(probs)
        log(
            f"{name}: train {row['train_s']:.0f}s; "
            + "; ".join(
                f"{test} acc {row[test]['accuracy']:.4f} mae {row[test]['mae_tokens']:.1f} "
                f"rho {row[test]['spearman']:.3f}"
                for test in ("validation_alpaca", *EVAL_DATASETS)
            )
        )
        results["variants"][name] = row
        accuracy = float(row["validation_alpaca"]["accuracy"])
        if accuracy > best[0]:
            best = (accuracy, name)
            state = {k: v.half().cpu() for k, v in model.state_dict().items()}
            torch.save({"variant": name, "config": asdict(config), "state": state},
                       args.out / "best.pt")  # fmt: skip
        del model
        torch.cuda.empty_cache()
    # The mean of the whole-mix cross-entropy runs' probabilities (seeds / lengths differ):
    # what averaging several models would buy, at several times the serving cost.
    results["ensemble_l6_e2"] = {
        test_name: score_probabilities(
            sum(rows) / len(rows), table, scheme, data.test[test_name], majority
        ).to_json()
        for test_name, rows in ensemble.items()
        if len(rows) > 1
    }
    results["best_by_validation"] = best[1]
    (args.out / "gpu_sweep.json").write_text(json.dumps(results, indent=2) + "\n")
    log(f"best by validation accuracy: {best[1]} ({best[0]:.4f})")


if __name__ == "__main__":
    main()
