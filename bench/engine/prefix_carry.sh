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
source "$(dirname "$0")/carry_lib.sh"
carry_start .prefixcarry
mkdir -p "$CARRY/datasets/traces"
cp "$SHARED/datasets/traces/mt_bench_question.jsonl" \
    "$SHARED/datasets/traces/mooncake_fast25_synthetic_trace.jsonl" "$CARRY/datasets/traces/"
carry_wheels xxhash protobuf
carry_done
