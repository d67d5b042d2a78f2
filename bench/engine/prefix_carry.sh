#!/usr/bin/env bash
# Copies what `python -m bench.engine.prefix` reads from ../shared into .prefixcarry/ (git-ignored),
# for the GPU machine, which gets the working tree but not ../shared: the GPT-2 tokenizer files
# and the two traces (MT-Bench questions, the synthetic Mooncake trace), about 2.5 MB.
#
# Run from the repository root:
#     bash bench/engine/prefix_carry.sh
# carry `.prefixcarry` and start the device command with
#     FEDLLM_SHARED_DIR=$PWD/.prefixcarry python3 -m bench.engine.prefix
set -euo pipefail
cd "$(dirname "$0")/../.."
SHARED="${FEDLLM_SHARED_DIR:-../shared}"
rm -rf .prefixcarry
mkdir -p .prefixcarry/tokenizers .prefixcarry/datasets/traces
cp -r "$SHARED/tokenizers/gpt2" .prefixcarry/tokenizers/
cp "$SHARED/datasets/traces/mt_bench_question.jsonl" \
    "$SHARED/datasets/traces/mooncake_fast25_synthetic_trace.jsonl" .prefixcarry/datasets/traces/
du -sh .prefixcarry
