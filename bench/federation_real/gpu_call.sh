#!/usr/bin/env bash
# Issue 78's device call, on `nvidia-h200-x2` (two H200s of one host): the gpu preset at deployed
# sizes (the 8B site at 256 sequences, the 1B at 1,024, 8,192 tokens a step), the pair's capacity
# measured through the gateway (a 20 s closed-loop saturation phase), then for each seed in SEEDS
# and each load (0.7x, 1.1x that capacity) the three arms on the same requests, 25 s of arrivals
# and at most 20 s of drain each. The simulated twins are made here afterwards, not on the device.
#
# Here first: `bash bench/federation_real/carry.sh`; the device command, carrying `.fedrealcarry`:
#     SEEDS=11,12 bash bench/federation_real/gpu_call.sh     # the whole grid, ~12.5 min
# or, where one command may run 10 minutes at most, one seed a call (each measures the capacity
# again; the second finds the models built if the machine is still warm), ~8 min each:
#     SEEDS=11 bash bench/federation_real/gpu_call.sh
#     SEEDS=12 bash bench/federation_real/gpu_call.sh
# Writes into $OUT: federation_real.log and per cell (seed, load) federation_real_h200_s<SEED>_x<LOAD>
# {_real.json,_requests.json.gz}, rewritten after each arm (a call cut short keeps the arms it
# finished). Then here, with those files copied to bench/results/federation_real/:
#     python -m bench.federation_real --compare bench/results/federation_real/federation_real_h200_s*_real.json
# which writes each cell's NAME.{json,md} (goodput_error, ttft_p50_error per arm, same_ranking)
# and federation_real_h200_grid.{json,md} (~1.5 min of CPU a cell on a 2-core machine).
#
# Where the time goes (the H100 run of issue 71 and the H200 serving-path run; the log's
# timestamps say it for this one): wheels ~10 s; the two models built at once ~35 s; both sites
# started at once with every CUDA graph captured ~60 s; a gateway start ~20 s, three of them;
# warm-up ~5 s; the saturation phase ~25 s; a cell ~45 s (1 s of start, 25 s of arrivals, up to
# 20 s of drain: the last 1,024-token answers at ~15 ms a step), six a seed.
set -u
OUT=${OUT:-/tmp/federation-real-call}
SEEDS=${SEEDS:-11,12}
LOADS=${LOADS:-0.7,1.1}  # a repeat of the over-capacity cells alone: LOADS=1.1
# Under the call's own limit (15 minutes for the grid, 10 for a seed), so that $OUT comes back
# with what was done.
if [[ $SEEDS == *,* ]]; then TIMEOUT_S=${TIMEOUT_S:-870}; else TIMEOUT_S=${TIMEOUT_S:-570}; fi
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .fedrealcarry/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
LOG=$OUT/federation_real.log
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$LOG"
set -o pipefail
timeout "$TIMEOUT_S" python3 -m bench.federation_real --preset gpu --gpus 2 --loads "$LOADS" \
    --seeds "$SEEDS" --tokenizer-dir "$PWD/.fedrealcarry/tokenizers/gpt2" --work-dir /tmp/fr \
    --out-dir "$OUT" --no-compare 2>&1 | tee -a "$LOG"
echo "bench.federation_real: exit $?" | tee -a "$LOG"
