"""What tokenizing a large prompt costs the gateway (issue 20, finding 3): seconds per MiB of
text with the tokenizer class the gateway serves (fedllm_contract.tokenizer.load_tokenizer, the
`encode` of gateway/tokenizers.py), for each tokenizer in the shared directory, on English-like
text and on one repeated character. `python -m bench.security.tokenize_cost [--tokenizers DIR]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from bench.common import markdown_table, results_dir, write_results
from fedllm_contract.tokenizer import load_tokenizer

MIB = 1 << 20
SHARED = Path(os.environ.get("FEDLLM_SHARED_DIR", Path(__file__).resolve().parents[3] / "shared"))
TEXTS = {
    "prose": (
        "The gateway routes each request to the site with the least predicted load. " * 20_000
    )[:MIB],
    "one character": "a" * MIB,
}


def seconds_per_mib(tokenizer_dir: Path, text: str, repeats: int = 3) -> tuple[float, int]:
    tokenizer = load_tokenizer(tokenizer_dir)
    runs, tokens = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        tokens = len(tokenizer.encode(text, add_special_tokens=False))
        runs.append(time.perf_counter() - started)
    return statistics.median(runs) * MIB / len(text.encode()), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizers", type=Path, default=SHARED / "tokenizers")
    args = parser.parse_args()
    rows = []
    for directory in sorted(p for p in args.tokenizers.iterdir() if p.is_dir()):
        for name, text in TEXTS.items():
            cost, tokens = seconds_per_mib(directory, text)
            rows.append([directory.name, name, cost, tokens])
    table = markdown_table(["tokenizer", "text (1 MiB)", "seconds per MiB", "tokens"], rows)
    print(table)
    write_results(
        "tokenize_cost",
        {"rows": rows, "threads_hint": os.cpu_count()},
        table,
        "python -m bench.security.tokenize_cost",
        results_dir("security"),
    )


if __name__ == "__main__":
    main()
