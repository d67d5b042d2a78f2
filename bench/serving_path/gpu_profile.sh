#!/usr/bin/env bash
# On the GPU machine: bench.serving_path's GPU mode, with py-spy sampling its site process in
# windows of WINDOW_S seconds from READY to exit, where the site's one interpreter lock goes
# (issue 78: the 1B site's tokens a second stop growing at ~50k, under the engine's 59-85k in
# process, its process at ~1.07 cores). Windows alternate between `--gil` (only the samples of
# the thread holding the lock: how the lock's time splits between the engine thread and the
# event loop, by function) and `--idle` (every thread's samples, waiting ones included: what the
# engine thread waits on). `--nonblocking`: the site is never paused to be read.
#
#     bash bench/federation_real/carry.sh && gzip -9 -c .venv/bin/py-spy > .fedrealcarry/py-spy.gz
# then, in the device call (carry [".fedrealcarry"]), after the carry's pip line:
#     bash bench/serving_path/gpu_profile.sh --tokenizer-dir $PWD/.fedrealcarry/tokenizers/gpt2 \
#         --work-dir /tmp/sp --name serving_path_gpu_h200_profile
# Writes $OUT/pyspy/wNN_{gil,idle}.txt (py-spy's raw format: one stack a line, its count last;
# the first frame the thread) and $OUT/pyspy/windows.txt (each window's start, seconds since
# the bench began), beside the bench's own files; `python -m bench.serving_path.pyspy_split
# $OUT/pyspy` reads them.
set -u
: "${OUT:?set OUT to the output folder}"
WINDOW_S=${WINDOW_S:-10}
RATE=${RATE:-250}
SPY=${SPY:-/tmp/py-spy}
if [ ! -x "$SPY" ]; then
    gunzip -c .fedrealcarry/py-spy.gz > "$SPY" && chmod +x "$SPY"
fi
mkdir -p "$OUT/pyspy"
python3 -m bench.serving_path --mode gpu --out-dir "$OUT" "$@" > "$OUT/serving_path.log" 2>&1 &
bench=$!
began=$SECONDS
site=""
while kill -0 "$bench" 2>/dev/null && [ -z "$site" ]; do
    sleep 1
    grep -q "site and gateway serving" "$OUT/serving_path.log" 2>/dev/null \
        && site=$(pgrep -f -- "-m site_engine" | head -1)
done
window=0
while [ -n "$site" ] && kill -0 "$site" 2>/dev/null; do
    mode=$([ $((window % 2)) -eq 0 ] && echo gil || echo idle)
    name=$(printf "w%02d_%s" "$window" "$mode")
    echo "$name $((SECONDS - began))" >> "$OUT/pyspy/windows.txt"
    "$SPY" record --pid "$site" --duration "$WINDOW_S" --rate "$RATE" --format raw --threads \
        --nonblocking "--$mode" -o "$OUT/pyspy/$name.txt" > /dev/null 2>> "$OUT/pyspy/py-spy.log"
    window=$((window + 1))
done
wait "$bench"
