#!/usr/bin/env bash
# Copies what `python -m bench.engine.prefix` reads from ../shared into .prefixcarry/ (git-ignored),
# for the GPU machine, which gets the working tree but not ../shared: the GPT-2 tokenizer files
# and the two traces (MT-Bench questions, the synthetic Mooncake trace), about 2.5 MB.
#
# Run from the repository root:
#     bash bench/engine/prefix_carry.sh
# carry `.prefixcarry` and start the device command with
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .prefixcarry/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#     FEDLLM_SHARED_DIR=$PWD/.prefixcarry python3 -m bench.engine.prefix
set -euo pipefail
cd "$(dirname "$0")/../.."
SHARED="${FEDLLM_SHARED_DIR:-../shared}"
rm -rf .prefixcarry
mkdir -p .prefixcarry/tokenizers .prefixcarry/datasets/traces
cp -r "$SHARED/tokenizers/gpt2" .prefixcarry/tokenizers/
cp "$SHARED/datasets/traces/mt_bench_question.jsonl" \
    "$SHARED/datasets/traces/mooncake_fast25_synthetic_trace.jsonl" .prefixcarry/datasets/traces/
PIP="${PIP:-.venv/bin/python -m pip}"
for name in xxhash protobuf; do
    spec="$(grep -i "^$name==" constraints.txt | head -1)"
    [[ -n "$spec" ]] || { echo "no pin for $name in constraints.txt" >&2; exit 1; }
    $PIP download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .prefixcarry/whl "$spec"
done
du -sh .prefixcarry
