"""The serving path's own cost (issue 74): what one site process and one gateway deliver of what
their engine makes, and what each spends per token on the way.

CPU mode (`--mode cpu`, the default; bench/serving_path/cpu_mode.py): a real site process whose
engine is a synthetic token source (bench/serving_path/synthetic_engine.py: 1,024 rows every
10 ms, real token ids of the site's tokenizer), started as `python -m site_engine` starts a site
(bench/serving_path/site.py), the real gateway in front of it, and 1,024 closed-loop streaming
`/v1/completions` clients in 4 processes. Each process's CPU µs per delivered token
(`site_cpu_us_per_token`, `gateway_cpu_us_per_token`, the clients' for information), delivered
and generated tokens/s, `path_vs_engine_tokens`, TTFT, TPOT, tokens per SSE chunk and the event
loops' busy share, over 3 windows of 30 s (median and min-max):

    python -m bench.serving_path --mode cpu --streams 1024 --name serving_path_cpu_before
    python -m bench.serving_path --mode cpu --quick --name smoke     (a few seconds: the wiring)

GPU mode (`--mode gpu`; bench/serving_path/gpu_mode.py): the real 1B-shaped engine in a site
process behind a 5 ms one-way delay and the gateway, open-loop Poisson arrivals of streaming
clients in 8 processes at 160 and 256 req/s (20 s of arrivals each), then the same requests at
the same times into the same engine in process, in one call on one card: `path_vs_engine_tokens`
{rate: ratio}, `ttft_p99_s` {rate: s}, refused and cut per rate. On a lent H200 (about 6
minutes: the model's build, two CUDA-graph captures, 2 x 2 rates of up to 40 s):

    bash bench/serving_path/carry.sh                 # here: .fedrealcarry/ (wheels, tokenizer)
    # the device call, carry [".fedrealcarry"]:
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .fedrealcarry/whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \\
    python3 -m bench.serving_path --mode gpu --tokenizer-dir .fedrealcarry/tokenizers/gpt2 \\
        --work-dir /tmp/sp --out-dir "$OUT" --name serving_path_gpu_before

`--rates`, `--duration-s`, `--drain-s` and `--clients` shorten or move it; `--preset cpu` runs
GPU mode's wiring with a tiny model on this machine's CPU (a smoke test, no figure). Results go
to bench/results/serving_path/NAME.{json,md}.
"""
