#!/usr/bin/env bash
# Prepares, here, what bench.engine.priority needs on the GPU machine beyond the working tree:
# the xxhash wheel (fedllm_contract/block_hash.py; the machine's image has torch, transformers
# and numpy but not it; version from constraints.txt, Python 3.12 manylinux x86_64) and the
# GPT-2 tokenizer. ../shared is not sent with the working tree, so these travel in the carried
# folder .issue52carry/ (git-ignored). (It carried batch_order's datasets too, until that study
# was retired: git tag study/batch-order.)
#
# Run from the repository root:
#     bash bench/engine/issue52_carry.sh
# then carry `.issue52carry` and run the command of docs/benchmarks.md's issue-52 row.
source "$(dirname "$0")/carry_lib.sh"
carry_start .issue52carry
carry_wheels xxhash
carry_done
