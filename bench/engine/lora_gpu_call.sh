#!/usr/bin/env bash
# The LoRA kernels' GPU call, on one H100/H200 (~3 minutes; the timeouts add up to 480 s):
#   1. tests/gpu/test_lora_kernels.py: the kernels against the float64 reference on the GPU
#      (bf16), the kernels' step against the PyTorch step, the engine with graphs against eager
#      and the fused model;
#   2. the kernels alone, each stack against its bytes floor (bench/engine/lora_kernel_bench.py);
#   3. the engine's decode step (bench.engine.lora_profile): the base, then the LoRA engine;
#   4. a short table of both (bench/engine/lora_call_summary.py), last, for the output's tail.
# Here first: `bash bench/engine/lora_carry.sh`; the device command, carrying `.loracarry`:
#     bash bench/engine/lora_gpu_call.sh
# Writes into $OUT: log.txt, lora_kernels_<card>.{json,md}, lora_profile_<card>.{json,md}.
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
    -rfs --durations=5 2>&1 | tee -a "$LOG"
echo "kernel tests: exit ${PIPESTATUS[0]}" | tee -a "$LOG"
timeout 120 python3 -m bench.engine.lora_profile --kernels-only --results-dir "$OUT" 2>&1 \
    | tee -a "$LOG"
timeout 180 python3 -m bench.engine.lora_profile --results-dir "$OUT" 2>&1 | tee -a "$LOG"
python3 -m bench.engine.lora_call_summary "$OUT" 2>&1 | tee -a "$LOG"
