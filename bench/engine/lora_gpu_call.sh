#!/usr/bin/env bash
# Issue 77's GPU call, on one H100/H200 (~6-7 minutes; the timeouts add up to 570 s): which LoRA
# kernel path stays, and the split-K path's best tuning, from one call's numbers.
#   1. the split-K kernels against the float64 reference on the GPU (bf16), under CUDA graphs
#      with and without PDL, and in the engine (graphs against eager, the fused model);
#   2. the kernels alone: both paths and the split-K variants (bench/engine/lora_kernel_bench.py),
#      the best split-K tuning chosen from them (`best_tuning`);
#   3. the engine's decode step (bench.engine.lora_profile): the base, then a LoRA engine per
#      path, the split-K one with the best tuning;
#   4. a short table of both (bench/engine/lora_call_summary.py), last, for the output's tail.
# Here first: `bash bench/engine/lora_carry.sh`; the device command, carrying `.loracarry`:
#     bash bench/engine/lora_gpu_call.sh
# Writes into $OUT: log.txt, lora_kernels_<card>.{json,md},
# lora_profile_<card>_{segmented,splitk}.{json,md} (7 files, under the 8 that come back).
set -u
OUT=${OUT:-/tmp/lora-gpu-call}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .loracarry/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD FEDLLM_SHARED_DIR=$PWD/.loracarry PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
    2>&1 | tee "$LOG"
timeout 150 python3 -m pytest -q -p no:randomly -m gpu tests/gpu/test_lora_kernels.py \
    -k splitk -rfs --durations=5 2>&1 | tee -a "$LOG"
echo "kernel tests: exit ${PIPESTATUS[0]}" | tee -a "$LOG"
timeout 210 python3 -m bench.engine.lora_profile --kernels-only --results-dir "$OUT" 2>&1 \
    | tee -a "$LOG"
TUNING=()
KERNELS=$(ls "$OUT"/lora_kernels_*.json 2>/dev/null | head -1)
[ -n "$KERNELS" ] && TUNING=(--lora-tuning-from "$KERNELS")
timeout 210 python3 -m bench.engine.lora_profile --lora-kernels segmented splitk \
    ${TUNING[@]+"${TUNING[@]}"} --results-dir "$OUT" 2>&1 | tee -a "$LOG"
python3 -m bench.engine.lora_call_summary "$OUT" 2>&1 | tee -a "$LOG"
