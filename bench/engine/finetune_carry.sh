#!/usr/bin/env bash
# Prepares, here, what `python -m bench.engine.finetune_colocated` (and
# bench.engine.finetune_profile) needs on the GPU machine
# beyond the working tree: the site's trainer imports peft, which the machine's image lacks (it
# has torch and transformers) and cannot download (no internet), so peft travels as a wheel with
# what it imports that the image may lack (accelerate, psutil), and the xxhash, protobuf and
# msgspec wheels (the block hashes, the contract; prefix_carry.sh found the image without the
# first two, and 2026-11-27's calls 6-7 failed on msgspec without .gpucarry beside), all at
# their constraints.txt pins for CPython 3.12 manylinux x86_64; and the GPT-2 tokenizer from
# ../shared (not sent with the working tree). Everything goes to .finetunecarry/ (git-ignored).
#
# Run from the repository root:
#     bash bench/engine/finetune_carry.sh
# carry `.finetunecarry` and run on the device (see bench/results/README.md for the command):
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .finetunecarry/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \
#     python3 -m bench.engine.finetune_colocated --preset gpu \
#         --tokenizer-dir .finetunecarry/tokenizers/gpt2 --results-dir "$OUT"
source "$(dirname "$0")/carry_lib.sh"
carry_start .finetunecarry
carry_wheels peft accelerate psutil xxhash protobuf msgspec
carry_done
