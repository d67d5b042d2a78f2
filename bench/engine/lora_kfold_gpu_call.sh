#!/usr/bin/env bash
# Issue 77's "expand folded into the base GEMM along K", measured on one H100/H200 without
# building it into the engine (~2 minutes; bench/results/engine_lora/kfold_notes_77.md says why
# it was not built): bench/engine/lora_kfold_gemm.py times, per stack of the 8B shape, the base
# GEMM, the GEMM over K extended by the used slots' columns and the engine's segmented shrink and
# expand for the same rows and slots (decode 256 rows over 8 and 64 adapters, prefill 2,048 over
# 8), and checks the layout in bf16. Torch and Triton are the image's: no carry, no wheels.
#
# From a tree at branch wt/lora:   bash bench/engine/lora_kfold_gpu_call.sh
# From a tree without the branch (the device copies the lead's checkout): the two modules and
# this script in an ignored folder, carried, e.g. in /work/main
#     mkdir -p .kfold && for f in lora_kfold_layout.py lora_kfold_gemm.py lora_kfold_gpu_call.sh;
#     do git show wt/lora:bench/engine/$f > .kfold/$f; done; echo /.kfold/ >> .git/info/exclude
# then the device command `bash .kfold/lora_kfold_gpu_call.sh`, carry [".kfold"], timeout 420.
# Writes into $OUT: log.txt, lora_kfold_<card>.{json,md}.
set -u -o pipefail
OUT=${OUT:-/tmp/lora-kfold-call}
mkdir -p "$OUT"
LOG=$OUT/log.txt
: >"$LOG"
HERE=$(cd "$(dirname "$0")" && pwd)
fail() {
    echo "lora_kfold_gpu_call: FAILED: $*" | tee -a "$LOG"
    exit 1
}
[ -f bench/common.py ] || fail "run from the repository root (no bench/common.py in $PWD)"
if [ "$HERE" != "$PWD/bench/engine" ]; then
    cp "$HERE"/lora_kfold_layout.py "$HERE"/lora_kfold_gemm.py bench/engine/ \
        || fail "cannot copy the modules from $HERE into bench/engine"
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
    2>&1 | tee -a "$LOG" || fail "nvidia-smi failed: no GPU here"
python3 -c "import torch, triton; assert torch.cuda.is_available(), 'torch sees no GPU'; \
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    2>&1 | tee -a "$LOG" || fail "torch or triton unusable"
timeout 360 python3 -m bench.engine.lora_kfold_gemm --results-dir "$OUT" 2>&1 | tee -a "$LOG"
rc=$?
echo "kfold bench: exit $rc (124: past its 360 s)" | tee -a "$LOG"
ls -l "$OUT" | tee -a "$LOG"
exit $rc
