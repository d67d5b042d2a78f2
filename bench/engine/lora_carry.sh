#!/usr/bin/env bash
# Copies what the LoRA GPU run reads from ../shared into .loracarry/ (git-ignored): the GPT-2
# tokenizer files, for `python -m bench.engine.lora` and tests/gpu/test_lora_kernels.py on the
# GPU machine, which gets the working tree but not ../shared; and the xxhash and protobuf wheels
# (the block hashes; prefix_carry.sh found the image without them). The bench writes its
# PEFT-format adapters with safetensors alone: peft is not needed; Triton is the image's own
# (3.6.0, as here).
#
# Run from the repository root:
#     bash bench/engine/lora_carry.sh
# carry `.loracarry`; the kernels' tests and profiles in one call are
# `bash bench/engine/lora_gpu_call.sh`; other commands start with
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .loracarry/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD \
#         FEDLLM_SHARED_DIR=$PWD/.loracarry
source "$(dirname "$0")/carry_lib.sh"
carry_start .loracarry
carry_wheels xxhash protobuf
carry_done
