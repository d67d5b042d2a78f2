#!/usr/bin/env bash
# Copies what the LoRA GPU run reads from ../shared into .loracarry/ (git-ignored): the GPT-2
# tokenizer files (~2 MB), for `python -m bench.engine.lora` and tests/gpu/test_lora_kernels.py
# on the GPU machine, which gets the working tree but not ../shared. Its image holds torch,
# transformers, safetensors, triton, xxhash and matplotlib (KINDS.md): no wheels to carry (the
# bench writes its PEFT-format adapters with safetensors alone; peft is not needed).
#
# Run from the repository root:
#     bash bench/engine/lora_carry.sh
# carry `.loracarry` and start the device command with
#     export FEDLLM_SHARED_DIR=$PWD/.loracarry
set -euo pipefail
cd "$(dirname "$0")/../.."
SHARED="${FEDLLM_SHARED_DIR:-../shared}"
rm -rf .loracarry
mkdir -p .loracarry/tokenizers
cp -r "$SHARED/tokenizers/gpt2" .loracarry/tokenizers/
du -sh .loracarry
