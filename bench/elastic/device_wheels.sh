#!/usr/bin/env bash
# Prepares what `python -m bench.elastic` (bench/elastic/device_pair.sh) and the site's GPU tests
# need on the GPU machine beyond the working tree:
# 1. .whl/: the wheels the gateway and the site engines need there
# (Python 3.12, manylinux x86_64), beyond what its image already holds (torch, transformers,
# tokenizers, onnxruntime, numpy, httpx, anyio, jinja2, prometheus-client, rich, click, pyyaml,
# multidict, typing-extensions: /work/.library/device/KINDS.md). Versions are constraints.txt's;
# grpcio and protobuf travel too because the generated site_pb2 needs protobuf 7 and
# grpcio-health-checking needs its own grpcio; pyzmq for the gateway (vLLM KV events).
# 2. .fedcarry/: SmolLM2's tokenizer (tokenizer files of var/models/SmolLM2-*, no weights), the
# Dolly file of the shared datasets, the Mooncake synthetic trace (traces/), and the served
# model's predictor artifact (FEDLLM_BENCH_PREDICTOR, default var/predictor/smollm2-135m-instruct:
# `python -m predictor.served_build` makes it; beside the wheels the MiniLM one may not fit the
# 64 MiB carry: the TF-IDF one,
# `python -m predictor.served_build --fast`, is var/predictor/smollm2-135m-instruct-tfidf).
# ../shared is not sent with the working tree, so these travel in a carried folder.
#
# Run from the repository root:
#     bash bench/elastic/device_wheels.sh
# then carry `.whl` and `.fedcarry` (about 45 MB together) and start the device command with
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/../.."
PIP="${PIP:-.venv/bin/python -m pip}"
rm -rf .whl && mkdir -p .whl
PLATFORMS=(manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64
    manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
pin() { grep -i "^$1==" constraints.txt | head -1; }
# Gateway (litestar app, SQLAlchemy + SQLite/Postgres, Alembic) and the gRPC contract.
PACKAGES=(litestar litestar-htmx msgspec multipart polyfactory Faker rich-click uvicorn
    SQLAlchemy greenlet aiosqlite alembic Mako psycopg psycopg-binary
    grpcio grpcio-health-checking protobuf typing_extensions annotated-doc sniffio pyzmq xxhash
    llguidance httptools)
for name in "${PACKAGES[@]}"; do
    spec="$(pin "$name")"
    [[ -n "$spec" ]] || { echo "no pin for $name in constraints.txt" >&2; exit 1; }
    $PIP download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platform_args[@]}" -d .whl "$spec"
done

rm -rf .fedcarry && mkdir -p .fedcarry/tokenizer .fedcarry/datasets/traces
tokenizer="$(ls -d var/models/SmolLM2-135M-Instruct-*/ | head -1)"
[[ -n "$tokenizer" ]] || { echo "no var/models/SmolLM2-*: run the tests' smollm2_dir once" >&2; exit 1; }
cp "$tokenizer"/tokenizer.json "$tokenizer"/tokenizer_config.json .fedcarry/tokenizer/
cp "$tokenizer"/chat_template.jinja .fedcarry/tokenizer/ 2>/dev/null || true
cp "${FEDLLM_DATA_DIR:-../shared/datasets}/dolly_3k.json" .fedcarry/datasets/
cp "${FEDLLM_DATA_DIR:-../shared/datasets}/traces/mooncake_fast25_synthetic_trace.jsonl" \
    .fedcarry/datasets/traces/
predictor="${FEDLLM_BENCH_PREDICTOR:-var/predictor/smollm2-135m-instruct}"
[[ -f "$predictor/manifest.json" ]] || { echo "no $predictor: python -m predictor.served_build" >&2; exit 1; }
# Serving reads the ONNX model, its tokenizer and the manifest; the torch weights (35 MB) only
# warm-start a retrain and stay here.
mkdir -p .fedcarry/predictor
cp "$predictor"/manifest.json "$predictor"/model.onnx "$predictor"/tokenizer.json .fedcarry/predictor/
du -sh .whl .fedcarry
total=$(du -sm .whl .fedcarry | awk '{s += $1} END {print s}')
if (( total > 63 )); then
    echo "carry is ${total} MiB, over the 64 MiB a device call takes: FEDLLM_BENCH_PREDICTOR=var/predictor/smollm2-135m-instruct-tfidf" >&2
    exit 1
fi
