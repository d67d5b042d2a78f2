#!/usr/bin/env bash
# Arms of the elastic benchmark side by side on one multi-GPU machine (nvidia-h100-x4): by
# default one seed's autoscaled arm on GPUs 0 and 1 next to its static-2 arm on GPUs 2 and 3,
# each with its own gateway and load generator, the same requests (same 1x, same seed). Run in
# the device call after installing the carried wheels (docs/elastic.md); results land in $OUT.
#     bash bench/elastic/device_pair.sh SEED NAME [CALIBRATION.json]
# Without a calibration file it first measures 1x alone on GPU 0 ($OUT/NAME_calibration.json).
# ARMS lists ARM:GPUS[:SEED] (a one-site arm names its GPU twice; SEED defaults to the first
# argument), e.g. the two seeds of the autoscaled arm at once:
#     ARMS="autoscaled:0,1:0 autoscaled:2,3:1" bash bench/elastic/device_pair.sh 0 NAME CAL
# or static 1 for two seeds: ARMS="static1:0,0:0 static1:1,1:1". The arm files are merged per
# seed afterwards, off the device:
#     python -m bench.elastic --preset gpu --no-arms --seed SEED --merge A.json B.json --name NAME_sSEED
set -uo pipefail
seed=$1 name=$2 calibration=${3:-}
common=(--preset gpu --tokenizer-dir .fedcarry/tokenizer --data-dir .fedcarry/datasets
    --trace-file .fedcarry/datasets/traces/mooncake_fast25_synthetic_trace.jsonl
    --predictor-dir .fedcarry/predictor --out-dir "$OUT")
if [[ -z "$calibration" ]]; then
    timeout 150 python3 -m bench.elastic "${common[@]}" --no-arms --work-dir /tmp/el-cal \
        --name "${name}_calibration" > "$OUT/${name}_calibration.log" 2>&1
    calibration="$OUT/${name}_calibration.json"
    tail -3 "$OUT/${name}_calibration.log"
    [[ -f "$calibration" ]] || exit 1
fi
specs=(${ARMS:-autoscaled:0,1 static2:2,3})
runs=()
for spec in "${specs[@]}"; do
    IFS=: read -r arm gpus arm_seed <<< "$spec"
    arm_seed=${arm_seed:-$seed}
    run="${name}_s${arm_seed}_${arm}"
    runs+=("$run")
    timeout "${ARM_TIMEOUT_S:-470}" python3 -m bench.elastic "${common[@]}" --seed "$arm_seed" \
        --arms "$arm" --merge "$calibration" --gpus "$gpus" --work-dir "/tmp/el-$arm-s$arm_seed" \
        --name "$run" > "$OUT/$run.log" 2>&1 &
done
wait
for run in "${runs[@]}"; do tail -4 "$OUT/$run.log"; done
# The device call brings back at most 8 files: the JSON results stay, the rest goes in one tar.
cd "$OUT" && tar czf "${name}_s${seed}_rest.tgz" --remove-files ./*.log ./*.md ./*.png 2>/dev/null
exit 0
