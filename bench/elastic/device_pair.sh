#!/usr/bin/env bash
# One seed of the autoscaled and the static-2 arms (or those ARMS names) side by side on a four-GPU machine
# (nvidia-h100-x4): autoscaled on GPUs 0 and 1, static2 on GPUs 2 and 3, each with its own
# gateway and load generator, the same requests (same 1x, same seed). Run in the device call
# after installing the carried wheels (docs/elastic.md); results land in $OUT.
#     bash bench/elastic/device_pair.sh SEED NAME [CALIBRATION.json]
# Without a calibration file it first measures 1x alone on GPU 0 ($OUT/NAME_calibration.json).
# The two arm files are merged afterwards, off the device:
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
# ARMS: which arm runs on which GPUs (a one-site arm names its GPU twice).
for spec in ${ARMS:-autoscaled:0,1 static2:2,3}; do
    arm=${spec%%:*} gpus=${spec#*:}
    timeout "${ARM_TIMEOUT_S:-470}" python3 -m bench.elastic "${common[@]}" --seed "$seed" \
        --arms "$arm" --merge "$calibration" --gpus "$gpus" --work-dir "/tmp/el-$arm" \
        --name "${name}_s${seed}_${arm}" > "$OUT/${name}_s${seed}_${arm}.log" 2>&1 &
done
wait
for spec in ${ARMS:-autoscaled:0,1 static2:2,3}; do arm=${spec%%:*}; tail -4 "$OUT/${name}_s${seed}_${arm}.log"; done
# The device call brings back at most 8 files: the JSON results stay, the rest goes in one tar.
cd "$OUT" && tar czf "${name}_s${seed}_rest.tgz" --remove-files ./*.log ./*.md ./*.png 2>/dev/null
exit 0
