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
set -euo pipefail
cd "$(dirname "$0")/../.."
SHARED="${FEDLLM_SHARED_DIR:-../shared}"
PIP="${PIP:-.venv/bin/python -m pip}"
OUT=.issue52carry
rm -rf "$OUT" && mkdir -p "$OUT/whl" "$OUT/tokenizers"
spec="$(grep -i '^xxhash==' constraints.txt | head -1)"
[[ -n "$spec" ]] || { echo "no pin for xxhash in constraints.txt" >&2; exit 1; }
$PIP download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$OUT/whl" "$spec"
cp -r "$SHARED/tokenizers/gpt2" "$OUT/tokenizers/"
tar czf "$OUT/datasets.tgz" -C "$SHARED" datasets/dolly_3k.json datasets/gsm8k_train.jsonl \
    datasets/alpaca.jsonl datasets/lima.json
du -sh "$OUT"
