#!/usr/bin/env bash
# Copies what the LoRA GPU run reads from ../shared into .loracarry/ (git-ignored): the GPT-2
# tokenizer files, for `python -m bench.engine.lora` and tests/gpu/test_lora_kernels.py on the
# GPU machine, which gets the working tree but not ../shared; and the xxhash and protobuf wheels
# (the block hashes; prefix_carry.sh found the image without them). The bench writes its
# PEFT-format adapters with safetensors alone: peft is not needed. And the LoRA kernels as they
# were before issue 69 (lora_kernels_baseline.py, from git), which
# `python -m bench.engine.lora_profile --kernels-only` times beside the current ones.
#
# Run from the repository root:
#     bash bench/engine/lora_carry.sh
# carry `.loracarry` and start the device command with
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .loracarry/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD \
#         FEDLLM_SHARED_DIR=$PWD/.loracarry
source "$(dirname "$0")/carry_lib.sh"
carry_start .loracarry
carry_wheels xxhash protobuf
# The commit before issue 69's kernels (main at cac8a4f).
git show cac8a4f:site_engine/engine/cuda/lora_kernels.py > "$CARRY/lora_kernels_baseline.py"
carry_done
