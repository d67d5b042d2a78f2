#!/usr/bin/env bash
# Prepares, here, what `python -m bench.engine.host_bound` reads on the GPU machine beyond the
# working tree, in .hostboundcarry/ (git-ignored): the GPT-2 tokenizer, the xxhash, protobuf
# and msgspec wheels the image lacks, the corpora of the short chat mix (alpaca, gsm8k, dolly,
# lima: datasets.tgz) and the engine package before issue 66 (main at cac8a4f:
# baseline_engine.tgz) for --baseline-engine.
#
# Run from the repository root:
#     bash bench/engine/host_bound_carry.sh
# carry `.hostboundcarry` and run on the device:
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .hostboundcarry/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \
#     mkdir -p /tmp/hb && tar xzf .hostboundcarry/datasets.tgz -C /tmp/hb && \
#     tar xzf .hostboundcarry/baseline_engine.tgz -C /tmp/hb && \
#     python3 -m bench.engine.host_bound --tokenizer-dir .hostboundcarry/tokenizers/gpt2 \
#         --data-dir /tmp/hb/datasets --baseline-engine /tmp/hb/site_engine/engine \
#         --results-dir "$OUT"
source "$(dirname "$0")/carry_lib.sh"
carry_start .hostboundcarry
carry_wheels xxhash protobuf msgspec
tar czf "$CARRY/datasets.tgz" -C "$SHARED" \
    datasets/alpaca.jsonl datasets/gsm8k_train.jsonl datasets/dolly_3k.json datasets/lima.json
git archive --format=tar.gz cac8a4f site_engine/engine > "$CARRY/baseline_engine.tgz"
carry_done
