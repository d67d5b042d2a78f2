#!/usr/bin/env bash
# Prepares, here, what bench/engine/issue52_gpu.sh needs on the GPU machine beyond the working
# tree (issue 52's two benches, bench.engine.priority and bench.engine.batch_order): the xxhash
# wheel (fedllm_contract/block_hash.py; the machine's image has torch, transformers and numpy but
# not it; version from constraints.txt, Python 3.12 manylinux x86_64), the GPT-2 tokenizer, and
# the four development datasets batch_order's mixes are built from, packed (about 7 MB).
# ../shared is not sent with the working tree, so these travel in the carried folder
# .issue52carry/ (git-ignored).
#
# Run from the repository root:
#     bash bench/engine/issue52_carry.sh
# then carry `.issue52carry` and run `bash bench/engine/issue52_gpu.sh` on the device.
source "$(dirname "$0")/carry_lib.sh"
carry_start .issue52carry
carry_wheels xxhash
tar czf "$CARRY/datasets.tgz" -C "$SHARED" datasets/dolly_3k.json datasets/gsm8k_train.jsonl \
    datasets/alpaca.jsonl datasets/lima.json
carry_done
