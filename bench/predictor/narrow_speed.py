"""What narrower encoder layers would save per prediction: speed only, accuracy is the sweep's.

    python -m bench.predictor.narrow_speed --predictor DIR [--repeats 300] [--evict-mib 64]
        [--name predictor_narrow_speed]

Takes a MiniLM artifact's weights, narrows copies of its layers (predictor.minilm.narrow_layer:
feed-forward neurons / attention heads kept), exports and quantizes each as training does (int8),
and times one prompt at a time on one thread, as the gateway runs it, with the weights out of the
caches (a buffer larger than the last-level cache read before every call). The copies are not
retrained: their predictions are meaningless, their cost is what a retrained one would cost.
Whether they predict as well is bench.predictor.gpu_sweep's `cpu_chars_f*` variants
(bench/results/predictor/predictor_narrow.md). Writes bench/results/NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bench.common import command_line, markdown_table, results_dir, write_results
from predictor.artifact import WEIGHTS_FILE, load_manifest
from predictor.encoding import PromptEncoder, prompt_chars

WIDTHS: tuple[tuple[int | None, int | None], ...] = (
    (None, None),
    (1024, None),
    (768, None),
    (768, 8),
    (512, 6),
)
PROMPTS = (
    "Say hello.",
    "Explain how the weather in Paris changes over the seasons and why, with examples.",
)


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _narrowed_model(artifact: Path, ffn_width: int | None, heads: int | None, out: Path) -> Path:
    from predictor.finetune import load_weights
    from predictor.minilm import build_classifier, export_onnx, narrow
    from predictor.quantize import quantize_int8

    manifest = load_manifest(artifact)
    model_config = manifest.training["config"]["model"]
    model = build_classifier(
        manifest.scheme.n_buckets,
        int(model_config["layers"]),
        length_feature=bool(model_config.get("prompt_length_feature", False)),
    )
    load_weights(model, artifact / WEIGHTS_FILE)
    narrow(model, ffn_width, heads)
    export_onnx(model, out / "fp32.onnx")
    quantize_int8(out / "fp32.onnx", out / "int8.onnx")
    return out / "int8.onnx"


def measure(artifact: Path, repeats: int, evict_mib: int) -> list[dict[str, object]]:
    encoder = PromptEncoder.from_dir(artifact, load_manifest(artifact).max_tokens)
    evict = np.ones(evict_mib * 1024 * 1024 // 8)
    rows: list[dict[str, object]] = []
    for ffn_width, heads in WIDTHS:
        with tempfile.TemporaryDirectory() as scratch:
            path = _narrowed_model(artifact, ffn_width, heads, Path(scratch))
            session = _session(path)
            size_mb = path.stat().st_size / 1e6
            inputs = {node.name for node in session.get_inputs()}
            row: dict[str, object] = {"ffn_width": ffn_width or 1536, "heads": heads or 12}
            row["onnx_mb"] = round(size_mb, 2)
            for prompt in PROMPTS:
                ids, mask = encoder.encode([prompt])
                feed = {"input_ids": ids, "attention_mask": mask}
                if "prompt_chars" in inputs:
                    feed["prompt_chars"] = prompt_chars([prompt])
                times = []
                for _ in range(repeats):
                    evict.sum()
                    started = time.perf_counter()
                    session.run(None, feed)
                    times.append((time.perf_counter() - started) * 1000)
                row[f"cold_ms_{ids.shape[1]}_tokens"] = round(statistics.median(times), 3)
            rows.append(row)
            print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.predictor.narrow_speed")
    parser.add_argument("--predictor", type=Path, required=True, help="a MiniLM artifact")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--evict-mib", type=int, default=64)
    parser.add_argument("--name", default="predictor_narrow_speed")
    args = parser.parse_args(argv)
    rows = measure(args.predictor, args.repeats, args.evict_mib)
    columns = list(rows[0])
    table = markdown_table(columns, [[row[c] for c in columns] for row in rows])
    text = (
        f"One prompt per call, one thread, int8, weights evicted ({args.evict_mib} MiB read) "
        f"before each call; medians of {args.repeats}. Copies of {args.predictor}'s layers "
        "narrowed without retraining: cost only.\n\n" + table + "\n"
    )
    command = command_line("bench.predictor.narrow_speed", argv)
    write_results(args.name, {"rows": rows}, text, command, results_dir("predictor"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
