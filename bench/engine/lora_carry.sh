#!/usr/bin/env bash
# Copies what the LoRA GPU run reads from ../shared into .loracarry/ (git-ignored): the GPT-2
# tokenizer files, for `python -m bench.engine.lora` and tests/gpu/test_lora_kernels.py on the
# GPU machine, which gets the working tree but not ../shared; and the xxhash and protobuf wheels
# (the block hashes; prefix_carry.sh found the image without them). The bench writes its
# PEFT-format adapters with safetensors alone: peft is not needed.
#
# Run from the repository root:
#     bash bench/engine/lora_carry.sh
# carry `.loracarry` and start the device command with
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .loracarry/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD \
#         FEDLLM_SHARED_DIR=$PWD/.loracarry
set -euo pipefail
cd "$(dirname "$0")/../.."
SHARED="${FEDLLM_SHARED_DIR:-../shared}"
rm -rf .loracarry
mkdir -p .loracarry/tokenizers
cp -r "$SHARED/tokenizers/gpt2" .loracarry/tokenizers/
PIP="${PIP:-.venv/bin/python -m pip}"
for name in xxhash protobuf; do
    spec="$(grep -i "^$name==" constraints.txt | head -1)"
    [[ -n "$spec" ]] || { echo "no pin for $name in constraints.txt" >&2; exit 1; }
    $PIP download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .loracarry/whl "$spec"
done
du -sh .loracarry
